"""The house stays one a newcomer can read: no module over 400 lines, no class over 300, no
function over 60, and llama_cpp imported only inside specllama/runtime/. And every test can
fail: each asserts something, itself or through a helper of the test modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specllama"
TESTS = Path(__file__).resolve().parent
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 400, 300, 60
# functions allowed past the limit, and why
LONGER = {
    "loader.py:load": "its docstring documents every argument of the public entry point (the body is ~55 lines)",
}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_class_or_function_is_too_long():
    too_long = []
    for path in modules():
        source = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if len(source.splitlines()) > MAX_MODULE:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            n = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
            if isinstance(node, ast.ClassDef) and n > MAX_CLASS:
                too_long.append(f"{name}:{node.name} (class) {n} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > MAX_FUNCTION \
                    and f"{name}:{node.name}" not in LONGER:
                too_long.append(f"{name}:{node.name} {n} lines")
    assert not too_long, too_long


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

