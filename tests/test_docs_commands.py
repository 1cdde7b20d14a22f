"""Every command in the README's and docs/' code blocks runs as shown: MODEL is the tiny test
model (scripts/tiny_models.py, a few MB: what is checked is that the command, its flags and its
output work, not a model's speed), the other placeholders are files in a temporary folder, and
an optional part in brackets is left out. A command that cannot run here is listed in SKIPPED
with the reason and the test that covers it instead, so a new command in the docs either runs or
is named there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a part of a command line that cannot run on this machine in a test, and why
SKIPPED = {
    "bash scripts/demo.sh": "fetches 3.5 GB and runs for minutes: run by hand, its figures in the README",
    "bash scripts/test.sh": "this suite itself: CI runs it",
    "specllama chat": "interactive: tests/test_terminal.py drives it in a pseudo-terminal",
    "specllama serve": "a server that runs until stopped: the server tests start it (tests/serving.py)",
    "specllama worker": "an RPC worker that runs until stopped: tests/test_rpc.py starts workers",
    "--rpc": "needs worker machines: tests/test_rpc.py starts local workers",
    "llama-3.3-70b": "a 40 GB download",
    "pip install": "changes the environment the suite runs in",
    "python -m pytest benchmarks": "the benchmarks: minutes to hours (docs/benchmarks.md)",
    "benchmarks/chat_modes.py": "a benchmark: minutes",
    "claude --model": "Claude Code, an npm agent, against a running server (tests/test_real_agents.py)",
}


def commands() -> list[tuple[str, str]]:
    """(doc name, command line) of every shell line in a bash, sh or untyped code block that
    runs specllama, a script or Python (continuation lines joined, comments cut)."""
    found = []
    for doc in DOCS:
        for kind, block in re.findall(r"^```([a-z]*)\n(.*?)^```", doc.read_text(), re.S | re.M):
            if kind not in ("bash", "sh", ""):
                continue
            for line in re.sub(r"\n\s+\[", " [", block).splitlines():
                code = re.split(r"\s{2,}#|\s#\s", line)[0].strip()
                if re.search(r"(^|\s|\| )(specllama \w|python |bash |\.venv/bin/|pip |\S+=\S+ claude)", code) \
                        and not code.startswith("specllama/"):
                    found.append((doc.name, code))
    return found


def runnable(code: str, tmp: Path, model: Path) -> str:
    """The command as a shell runs it here: optional parts left out, placeholders filled."""
    code = re.sub(r"\s\[[^\]]*\]", "", code)
    for placeholder, value in (("MODEL", str(model)), ("DIR", str(tmp / "cache")), ("my.jsonl", str(tmp / "p.jsonl"))):
        code = re.sub(rf"(?<![\w/.-]){re.escape(placeholder)}(?![\w/-])", value, code)
    return code


def test_the_docs_have_the_commands_this_test_reads():
    found = [code for _, code in commands()]
    assert 'specllama run MODEL "prompt"' in found and "specllama plan MODEL [--draft D] [--ctx N]" in found
    assert any(code.startswith("specllama serve MODEL [--draft") and "[--strict-model]" in code for code in found)
    plan = runnable("specllama plan MODEL [--draft D] [--ctx N]", Path("/t"), Path("/m.gguf"))
    assert plan == "specllama plan /m.gguf"


@pytest.mark.children
def test_every_command_in_the_docs_runs(tiny_paths, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "Count from one to five."}\n')
    env = {**os.environ, "SPECLLAMA_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran, failed = [], []
    for doc, code in commands():
        if any(part in code for part in SKIPPED):
            continue
        line = runnable(code, tmp_path, tiny_paths["attention-draft"])
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        ran.append(code)
        if done.returncode != 0 or "Traceback" in done.stderr:
            failed.append(f"{doc}: {code}: exit {done.returncode}: {done.stderr[-600:]}")
    assert not failed, failed
    assert len(ran) >= 12, ran
    assert (tmp_path / "bench.png").stat().st_size > 10_000  # the --plot example drew its file
