"""The house stays one a newcomer can read: llama_cpp imported only inside specllama/runtime/,
no modules importing each other in a loop, no module reaching into another module's private
names, every module placed and described in docs/layout.md (sizes past the review figures are
warnings there, prompts for a split by concern). And every test can fail: each asserts
something, itself or through a helper of the test modules."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specllama"
TESTS = Path(__file__).resolve().parent
LAYOUT = PACKAGE.parent / "docs" / "layout.md"
# sizes past which review asks whether a second concern wants a home of its own (docs/layout.md)
REVIEW_MODULE, REVIEW_CLASS, REVIEW_FUNCTION = 400, 300, 60


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def size_prompts(paths: list[Path]) -> list[str]:
    """Modules, classes and functions past the review sizes, with their lengths."""
    prompts = []
    for path in paths:
        source = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if len(source.splitlines()) > REVIEW_MODULE:
            prompts.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                limit = REVIEW_CLASS if isinstance(node, ast.ClassDef) else REVIEW_FUNCTION
                if n > limit:
                    prompts.append(f"{name}:{node.name} {n} lines")
    return prompts


def unlisted(paths: list[Path], page: str) -> tuple[list[str], list[str]]:
    """(modules no row of the page names, rows that name no module): a folder's
    __init__.py is described by its folder's section, the package's own by a row."""
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", page, re.MULTILINE))  # a table row's first cell
    wanted = {str(p.relative_to(PACKAGE)) for p in paths
              if p.name != "__init__.py" or p.parent == PACKAGE}
    return sorted(wanted - named), sorted(n for n in named - wanted if not n.startswith("scripts/"))


def test_docs_layout_lists_every_module_and_sizes_are_review_prompts():
    """docs/layout.md describes every module, so one that lands is placed and named; sizes past
    the review figures are warned about in every run, never failed on (a split is by concern)."""
    assert unlisted(modules(), LAYOUT.read_text()) == ([], [])
    # the check sees a module missing from the page, and a row left behind by a move
    sample = [PACKAGE / "engine.py", PACKAGE / "decoding" / "decode.py", PACKAGE / "decoding" / "__init__.py"]
    assert unlisted(sample, "| `engine.py` | x |\n| `decode.py` | y |") == (["decoding/decode.py"], ["decode.py"])
    for prompt in size_prompts(modules()):
        warnings.warn(f"review prompt (docs/layout.md): {prompt}", stacklevel=1)


def test_only_the_runtime_imports_llama_cpp():
    outside = []
    for path in modules():
        if path.relative_to(PACKAGE).parts[0] == "runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            outside += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] == "llama_cpp"]
    assert not outside, outside


# calls that check something: pytest's, and numpy.testing's assert_* (any name starting so)
CHECKING_CALLS = ("raises", "fail", "warns", "approx")


def unasserted_tests(paths: list[Path]) -> list[str]:
    """Test functions in paths that neither assert, nor call pytest.raises/fail/warns or an
    assert_* function, nor call a function of these modules that does (followed through)."""
    trees = [(path, ast.parse(path.read_text())) for path in paths]
    helpers: dict[str, list[ast.AST]] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                helpers.setdefault(node.name, []).append(node)

    def checks(function: ast.AST, seen: set[str]) -> bool:
        for node in ast.walk(function):
            if isinstance(node, ast.Assert):
                return True
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                    node.func.id if isinstance(node.func, ast.Name) else ""
                if name in CHECKING_CALLS or name.startswith("assert_"):
                    return True
                if name in helpers and name not in seen:
                    seen.add(name)
                    if any(checks(helper, seen) for helper in helpers[name]):
                        return True
        return False

    return [f"{path.name}:{node.lineno} {node.name}" for path, tree in trees for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
            and not checks(node, set())]


def test_every_test_asserts_something(tmp_path):
    assert unasserted_tests(sorted(TESTS.glob("*.py"))) == []
    # and the check finds one that does not (a call that only runs, as a test once did)
    module = tmp_path / "test_example.py"
    module.write_text("def helper(x):\n    assert x\n\n\ndef run(x):\n    return x\n\n\n"
                      "def test_checked():\n    helper(1)\n\n\ndef test_runs_only():\n    run(1)\n")
    assert unasserted_tests([module]) == ["test_example.py:13 test_runs_only"]



def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules path imports anywhere in it (in functions, and for type checking,
    too: an import moved into a function hides a loop from the interpreter, not from a reader)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:  # `from . import x`: the module x, where it is one
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known and name != module_name(path)}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_modules_import_each_other_in_a_loop():
    """A loop means neither module can be read, tested or moved without the other; the lazy
    package faces (specllama/__init__.py, runtime/__init__.py import on first use) are not
    edges, as they import nothing themselves."""
    paths = modules()
    known = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, known) - {"specllama", "specllama.runtime"} for p in paths}
    assert import_cycles(graph) == []
    # the reader sees loops where there are some
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "specllama.runtime.loading" in graph["specllama.runtime.core"]


def private_reaches(path: Path) -> list[str]:
    """obj._name where obj is not self, cls or super() and no class of path's module defines
    _name: a reach into another module's object (its owner may change it at will)."""
    tree = ast.parse(path.read_text())
    own = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
           and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")}
    own |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {t.id for node in ast.walk(tree) if isinstance(node, (ast.AnnAssign, ast.Assign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    reaches = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                and not (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super") \
                and node.attr not in own:
            reaches.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return reaches


def test_no_module_reaches_into_another_module_s_private_names(tmp_path):
    assert [r for path in modules() for r in private_reaches(path)] == []
    sample = tmp_path / "m.py"
    sample.write_text("class A:\n    def __init__(self):\n        self._x = 1\n\n"
                      "def f(a, b):\n    return a._x + b._y + super()._z\n")
    assert [r.split(": ")[1] for r in private_reaches(sample)] == ["b._y"]
