"""The real coding agents against a real `specllama serve`: Claude Code (`claude -p`, Anthropic
Messages) and the Codex CLI (`codex exec`, OpenAI Responses), each asked for a small task in a
temporary folder. What must work is the protocol: each agent completes its run without a
protocol error. Whether the 1.5B test model does the task well is reported, not asserted.

Long on 2 cores (Claude Code's prompt is about 11,600 tokens: its first prefill takes minutes),
so behind SPECLLAMA_AGENTS=1. The agents come from npm (Node 20), installed once into the test
model cache (SPECLLAMA_TEST_MODELS/agents).

    SPECLLAMA_AGENTS=1 .venv/bin/python -m pytest tests/test_real_agents.py -s
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import fetch_models
from serving import serve

pytestmark = [pytest.mark.skipif(os.environ.get("SPECLLAMA_AGENTS") != "1",
                                 reason="real agents are long here: SPECLLAMA_AGENTS=1 runs them"),
              pytest.mark.children]
AGENTS = {"@anthropic-ai/claude-code": "2.1.332", "@openai/codex": "0.171.0"}
KEY = "agent-key"
TASK = "Create a file hello.py that prints hello."


@pytest.fixture(scope="module")
def agents() -> Path:
    where = fetch_models.cache_dir() / "agents"
    bin_dir = where / "node_modules" / ".bin"
    if not (bin_dir / "claude").exists() or not (bin_dir / "codex").exists():
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", *(f"{k}@{v}" for k, v in AGENTS.items())],
                       cwd=where, check=True, timeout=900)
    return bin_dir


@pytest.fixture(scope="module")
def server(model_paths, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve(model_paths["target"], log, "--draft", str(model_paths["draft"]), "--api-key", KEY, "--ctx", "32768",
               timeout=300) as (base, _):
        yield base, log


def turns(log: Path, since: int) -> list[str]:
    """The server's line for each request since byte `since` of its log."""
    text = log.read_text()[since:]
    return [line for line in text.splitlines() if re.match(r"specllama: (messages|responses):", line)]


def test_claude_code_completes_a_run(agents, server, tmp_path):
    base, log = server
    since = len(log.read_text())
    env = {**os.environ, "HOME": str(tmp_path / "home"), "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": KEY,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_ERROR_REPORTING": "1", "IS_SANDBOX": "1"}
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run([str(agents / "claude"), "-p", TASK, "--model", "qwen-local", "--permission-mode",
                          "bypassPermissions", "--output-format", "json"], cwd=work, env=env, capture_output=True,
                         text=True, timeout=1800)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print("\nclaude -p:", {k: result.get(k) for k in ("subtype", "is_error", "num_turns", "ttft_ms", "duration_ms")})
    print("  result:", repr(result.get("result", ""))[:300], "| hello.py written:", (work / "hello.py").exists())
    for line in turns(log, since):
        print("  ", line)
    assert out.returncode == 0 and result["subtype"] == "success" and not result["is_error"], out.stderr[-2000:]
    assert turns(log, since), "no request reached the server"


def test_codex_completes_a_run(agents, server, tmp_path):
    base, log = server
    since = len(log.read_text())
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(f'''model = "qwen-local"
model_provider = "specllama"
approval_policy = "never"
sandbox_mode = "workspace-write"

[model_providers.specllama]
name = "specllama"
base_url = "{base}/v1"
env_key = "SPECLLAMA_KEY"
wire_api = "responses"
''')
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "CODEX_HOME": str(home), "SPECLLAMA_KEY": KEY, "HOME": str(tmp_path / "home")}
    out = subprocess.run([str(agents / "codex"), "exec", "--skip-git-repo-check", TASK], cwd=work, env=env,
                         capture_output=True, text=True, timeout=1800)
    print("\ncodex exec:", out.returncode, "| hello.py written:", (work / "hello.py").exists())
    print("  last lines:", out.stdout.strip().splitlines()[-3:], out.stderr.strip().splitlines()[-3:])
    for line in turns(log, since):
        print("  ", line)
    assert turns(log, since), "no request reached the server"
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stream error" not in out.stderr.lower() and "unexpected status" not in out.stderr.lower()
