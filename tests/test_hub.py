"""Hub paths against a local stand-in server, with the real huggingface_hub client."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from specllama.models import gguf_check, registry
from specllama.cli import main
from specllama.models.draft_select import select_draft
from specllama.models.hub import Hub, HubError
from specllama.models.resolve import resolve

from hubserver import HubServer, Repo

TARGET_REPO = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"
DRAFT_REPO = "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"
SMOL_DECOY = "someone/Qwen2.5-Coder-0.1B-Instruct-GGUF"  # same basename, SmolLM2's vocabulary
GEMMA_DECOY = "other/Qwen2.5-Coder-0.2B-Instruct-GGUF"  # same basename, Gemma's vocabulary
GATED = "gatedorg/Qwen2.5-Coder-0.3B-Instruct-GGUF"
BIGGER = "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF"


@pytest.fixture(scope="module")
def server(model_paths, tmp_path_factory):
    split_dir = tmp_path_factory.mktemp("split")
    parts = {}
    for i in (1, 2):
        p = split_dir / f"tiny-q4_k_m-0000{i}-of-00002.gguf"
        p.write_bytes(bytes([i]) * 1000)
        parts[p.name] = p
    srv = HubServer([
        Repo(TARGET_REPO, {"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": model_paths["target"]}, downloads=500),
        Repo(DRAFT_REPO, {"qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": model_paths["draft"]}, downloads=900),
        Repo(SMOL_DECOY, {"qwen2.5-coder-0.1b-instruct-q8_0.gguf": model_paths["smollm2"]}, downloads=5),
        Repo(GEMMA_DECOY, {"qwen2.5-coder-0.2b-instruct-q8_0.gguf": model_paths["gemma"]}, downloads=7),
        Repo(GATED, {"qwen2.5-coder-0.3b-instruct-q8_0.gguf": model_paths["draft"]}, downloads=50, gated=True),
        Repo(BIGGER, {"qwen2.5-coder-7b-instruct-q4_k_m.gguf": model_paths["target"]}, downloads=9000),
        Repo("tiny/split-GGUF", parts),
    ]).start()
    yield srv
    srv.stop()


@pytest.fixture
def hub_env(server, tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("SPECLLAMA_HOME", str(tmp_path / "home"))
    return cache


def header_size(path) -> int:
    return gguf_check.read_header(path).data_offset


def test_auto_selection_picks_the_0_5b_and_never_downloads_decoy_weights(server, hub_env, model_paths):
    hub, reg = Hub.from_env(), registry.load()
    target = resolve(TARGET_REPO, hub, reg)
    assert target.path.stat().st_size == model_paths["target"].stat().st_size
    before = {r: server.served(r) for r in (SMOL_DECOY, GEMMA_DECOY, GATED, BIGGER)}
    decision = select_draft(target.path, hub, reg, repo_id=target.repo_id, filename=target.filename,
                            revision=target.revision)
    assert decision.chosen is not None and decision.chosen.repo_id == DRAFT_REPO
    verdicts = {c.repo_id: c for c in decision.candidates if c.repo_id}
    assert "vocabulary sizes differ" in verdicts[SMOL_DECOY].reason
    assert "vocabulary type differs" in verdicts[GEMMA_DECOY].reason
    assert "gated" in verdicts[GATED].reason
    assert BIGGER not in verdicts, "a larger model was considered as a draft"
    # rejected candidates: only part of their header was ever read
    assert 0 < server.served(SMOL_DECOY) - before[SMOL_DECOY] < header_size(model_paths["smollm2"])
    assert 0 < server.served(GEMMA_DECOY) - before[GEMMA_DECOY] < header_size(model_paths["gemma"])
    assert server.served(GATED) == before[GATED] == 0
    assert server.served(BIGGER) == 0
    # the winner was downloaded whole into the HF cache
    assert decision.draft_path and str(hub_env) in decision.draft_path
    assert decision.header_bytes == sum(c.header_bytes for c in decision.candidates)


def test_decision_is_cached_and_offline_works(server, hub_env):
    hub, reg = Hub.from_env(), registry.load()
    target = resolve(TARGET_REPO, hub, reg)
    first = select_draft(target.path, hub, reg, repo_id=target.repo_id, filename=target.filename,
                         revision=target.revision)
    n_requests = len(server.requests)
    again = select_draft(target.path, hub, reg, repo_id=target.repo_id, filename=target.filename,
                         revision=target.revision)
    assert again.from_cache and again.draft_path == first.draft_path
    assert len(server.requests) == n_requests, "a cached decision made network calls"
    # offline: target and draft come from the HF cache, even without the cached decision
    offline = Hub(endpoint="http://127.0.0.1:9", cache_dir=hub.cache_dir, offline=True)
    t = resolve(TARGET_REPO, offline, reg)
    assert t.path == target.path
    fresh = select_draft(t.path, offline, reg, repo_id=t.repo_id, filename=t.filename, use_cache=False)
    assert fresh.chosen is not None and "qwen2.5-coder-0.5b" in fresh.draft_path
    assert len(server.requests) == n_requests


def test_quant_choice_and_split_parts(server, hub_env):
    hub, reg = Hub.from_env(), registry.load()
    r = resolve("tiny/split-GGUF", hub, reg)
    assert r.path.name == "tiny-q4_k_m-00001-of-00002.gguf"
    assert (r.path.parent / "tiny-q4_k_m-00002-of-00002.gguf").exists()
    with pytest.raises(HubError, match="no Q8_0 file; quants there: Q4_K_M"):
        resolve("tiny/split-GGUF:q8_0", hub, reg)


@pytest.mark.parametrize("ref, message", [
    ("nobody/missing-GGUF", "not found"),
    (GATED, "gated.*HF_TOKEN"),
])
def test_hub_errors_say_what_to_do(server, hub_env, ref, message):
    with pytest.raises(HubError, match=message):
        resolve(ref, Hub.from_env(), registry.load())


def test_offline_and_not_cached(hub_env):
    hub = Hub(cache_dir=hub_env, offline=True)
    with pytest.raises(HubError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve(DRAFT_REPO, hub, registry.load())


@pytest.mark.slow  # the CLI's auto draft: test_subprocess_run_with_local_target_auto_draft; the hub: above
def test_cli_run_with_auto_draft_from_the_hub(server, hub_env, pair):
    runner = CliRunner()
    result = runner.invoke(main, ["run", TARGET_REPO, "def add(a, b):", "--raw", "--max-tokens", "16", "--n-draft", "2",
                                  "--threads", "2", "--ctx", "2048", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["models"]["draft"] == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert data["tokens"] == pair.generate("def add(a, b):", max_tokens=16).tokens
    assert data["stats"]["n_drafted"] > 0


def test_cli_draft_command_json(server, hub_env):
    result = CliRunner().invoke(main, ["draft", TARGET_REPO, "--json", "--no-download"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["chosen"]["repo_id"] == DRAFT_REPO
    assert data["header_bytes"] > 0
    assert {c["verdict"] for c in data["candidates"]} >= {"rejected", "compatible"}


def test_cli_errors_are_one_line(server, hub_env):
    result = CliRunner().invoke(main, ["run", "nobody/missing-GGUF", "hi"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "not found" in lines[0] and "Traceback" not in result.output


@pytest.mark.children
def test_subprocess_run_with_local_target_auto_draft(model_paths, pair, tmp_path):
    """A real `specllama run` process on a fresh machine: auto-selects the 0.5B next to the
    target, measures first what its one request uses (not how prefills go beside other
    requests: 16 s of a first run's 19 s of measuring here), streams the API's text."""
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("target", "draft", "smollm2"):
        (folder / model_paths[name].name).symlink_to(model_paths[name])
    exe = shutil.which("specllama", path=str(__import__("pathlib").Path(sys.executable).parent))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SPECLLAMA_HOME": str(tmp_path / "home"),
           "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")}
    prompt = "def fibonacci(n):"
    proc = subprocess.run([exe, "run", str(folder / model_paths["target"].name), prompt, "--raw",
                           "--max-tokens", "24", "--threads", "2", "--ctx", "2048"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" in proc.stderr
    first = next(line for line in proc.stderr.splitlines() if "first use of" in line)
    assert "the decode-cost curve" in first and "in pieces" not in first, first
    expected = pair.generate(prompt, max_tokens=24).text
    assert proc.stdout.rstrip("\n") == expected.rstrip("\n") or proc.stdout == expected + "\n"


def test_a_download_cut_mid_file_resumes(server, hub_env, model_paths):
    hub = Hub.from_env()
    name = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    size = model_paths["draft"].stat().st_size
    server.drop_after[(DRAFT_REPO, name)] = size // 3
    before = server.served(DRAFT_REPO)
    try:
        path = hub.download(DRAFT_REPO, name)
    except Exception:  # huggingface_hub gave up on this try: the next one resumes from the partial file
        path = hub.download(DRAFT_REPO, name)
    served = server.served(DRAFT_REPO) - before
    assert (DRAFT_REPO, name) not in server.drop_after, "the connection was never cut"
    assert path.stat().st_size == size
    assert gguf_check.read_header(path).data_end == size
    assert size <= served < size + size // 3, "the download started over instead of resuming"


def test_wrong_checksum_is_detected_and_the_file_not_used(server, hub_env, tmp_path):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / "models.toml").write_text(
        "[sha256]\n" f'"{DRAFT_REPO}/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" = "{"0" * 64}"\n')
    with pytest.raises(HubError, match="does not match its SHA-256 in models.toml.*removed"):
        resolve(DRAFT_REPO, Hub.from_env(), registry.load())
    cached = [p for _, _, p in Hub.from_env().cached_ggufs()]
    assert not any("0.5b" in str(p) for p in cached)


def test_unreachable_hub_falls_back_to_models_on_disk(model_paths, tmp_path):
    """No network and no HF_HUB_OFFLINE (a fresh machine): the draft next to the target is found."""
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("target", "draft"):
        (folder / model_paths[name].name).symlink_to(model_paths[name])
    hub = Hub(endpoint="http://127.0.0.1:9", cache_dir=tmp_path / "hf")  # nothing listens on port 9
    decision = select_draft(folder / model_paths["target"].name, hub, registry.load(), use_cache=False)
    assert decision.draft_path is not None and "0.5b" in decision.draft_path
    remote = [c for c in decision.candidates if c.repo_id]
    assert remote and all("cannot reach the Hub" in c.reason for c in remote)


def _can_mount_a_small_disk() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_a_small_disk(), reason="needs unshare and user namespaces (Linux)")
def test_a_full_disk_is_reported_as_such(server, hub_env):
    """A real full disk: the Hub cache is a 32 MiB tmpfs mounted in a private user+mount namespace,
    and the 0.5B draft (469 MiB) is downloaded into it through the CLI."""
    hub_env.mkdir(parents=True)
    script = (f"mount -t tmpfs -o size=32m tmpfs '{hub_env}' && "
              f"'{sys.executable}' -m specllama run {DRAFT_REPO} hello --draft none --max-tokens 1; "
              f"echo \"exit=$?\"; find '{hub_env}' -type f -size +1M")
    proc = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert "exit=1" in proc.stdout, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no space left on device" in errors[0] and "HF_HOME" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip().endswith("exit=1"), "a partial download was left in the cache:\n" + proc.stdout
