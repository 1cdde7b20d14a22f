"""The README and docs/ name only what exists: every `specllama CMD --flag` they show is a flag of
that command, every SPECLLAMA_ variable they name is read somewhere, and every variable the
package and scripts read is documented."""

from __future__ import annotations

import re
from pathlib import Path

import click

from specllama.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# what a `specllama CMD ...` span may be cut at: another command follows
_END = re.compile(r"\s(\||&&|;|>|2>)\s")


def flags_of(command: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for param in command.params:
        names.update(getattr(param, "opts", []))
        names.update(getattr(param, "secondary_opts", []))
    return names


def command_spans(text: str) -> list[tuple[str, str]]:
    """(command, the rest of the span) of every `specllama CMD ...` in a code block line or an
    inline code span."""
    spans = []
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for line in lines:
        for match in re.finditer(r"(?:^|[\s/])specllama ([a-z][a-z-]*)((?: [^\s`#]+)*)", line):
            rest = _END.split(match.group(2))[0]
            spans.append((match.group(1), rest))
    return spans


def test_every_flag_the_docs_show_belongs_to_its_command():
    wrong = []
    for doc in DOCS:
        for name, rest in command_spans(doc.read_text()):
            command = main.commands.get(name)
            if command is None:
                if name not in ("is", "makes", "measures", "decodes", "runs", "keeps", "and"):  # prose, not a command
                    wrong.append(f"{doc.name}: specllama {name}: no such command")
                continue
            for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", rest):
                if flag not in flags_of(command) and not flag.startswith("-" + "0123456789"):
                    wrong.append(f"{doc.name}: specllama {name} {flag}")
    assert not wrong, wrong


# flags the docs name that are other programs': llama-server's, benchmarks/chat_modes.py's
FOREIGN = {"--spec-draft-n-max", "--spec-type", "--modes"}


def test_every_flag_named_alone_is_a_flag_of_some_command():
    """`--temp` in a sentence (the README's list of run's flags, ...): some command has it."""
    known = set().union(*(flags_of(c) for c in main.commands.values())) | FOREIGN
    wrong = []
    for doc in DOCS:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        wrong += [f"{doc.name}: {flag}" for flag in re.findall(r"`(--[a-z][\w-]*)[^`]*`", prose) if flag not in known]
    assert not wrong, wrong


def test_the_docs_find_flags_in_code_spans():
    """The reader above sees what it should (so the test above can fail)."""
    spans = command_spans("Run `specllama run MODEL --ctx 0 | head` or\n"
                          "```bash\n.venv/bin/specllama serve M --port 1\n```")
    assert ("run", " MODEL --ctx 0") in spans and ("serve", " M --port 1") in spans


def variables(paths: list[Path]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        found.update(re.findall(r"SPECLLAMA_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    return found


def test_every_variable_the_package_reads_is_documented_and_every_documented_one_exists():
    package = [*ROOT.glob("specllama/**/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("scripts/*.sh")]
    everything = package + [*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"), ROOT / ".ci" / "run"]
    documented = variables(DOCS)
    assert variables(package) - documented == set()
    examples = {"SPECLLAMA_KEY"}  # docs/server.md: a name the reader's own config gives its key
    assert documented - variables(everything) - examples == set()
