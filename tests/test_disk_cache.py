"""The prompt cache on disk: states that outlive the process, restored only where they are exactly
what this model, build and settings would compute, and never a reason for a different output.

Mechanics run on the tiny attention model (scripts/tiny_models.py, 26 MB); the fidelity promise
runs on the real pair, as the RAM cache's test does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import llama_cpp
import numpy as np
import pytest

import specllama
from specllama.caching import disk_cache
from specllama.caching.disk_cache import DiskCache, listing
from specllama.runtime import PrefillRow, SavedState

from conftest import ROOT, SETTINGS
from test_long_context import first_difference, record_rows
from test_prompt_cache import CHUNK, N_TOKENS, conversation, turns, turns_prompt

TINY = dict(n_ctx=512, n_threads=2, n_batch=32)
# a prompt of a few hundred tokens: past MIN_SAVE, so close() keeps it
PROMPT = "def parse(line):\n    fields = line.split(',')\n    return [int(f) for f in fields]\n" * 6
KEY = {"format": 1, "model": "m", "n_batch": 32}


def state(tokens, n_bytes=1000, seed=0, row=True):
    data = bytearray(np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8).tobytes())
    kept = PrefillRow(len(tokens), np.arange(8, dtype=np.float32) + seed, True) if row else None
    return SavedState(list(tokens), len(tokens), data, kept, "")


def written(disk, key, s):
    disk.put(key, "m.gguf", s)
    disk.flush()


# --- the folder, on synthetic states --------------------------------------------------------

def test_a_state_comes_back_whole_under_its_key_only(tmp_path):
    disk = DiskCache(tmp_path, 1)
    s = state(range(100))
    written(disk, KEY, s)
    [entry] = disk.entries(KEY)
    back = disk.read(entry)
    assert back.tokens == s.tokens and back.data == s.data and back.n_canonical == 100
    assert back.prefill_row.n_tokens == 100 and np.array_equal(back.prefill_row.logits, s.prefill_row.logits)
    for other in ({**KEY, "model": "other"}, {**KEY, "n_batch": 64}, {**KEY, "format": 2}):
        assert disk.entries(other) == []
    disk.close()


def test_a_key_id_collision_is_caught_by_the_full_key_in_the_header(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_cache, "key_id", lambda key: "same")  # every key's files under one name
    disk = DiskCache(tmp_path, 1)
    written(disk, KEY, state(range(10)))
    fresh = DiskCache(tmp_path, 1)
    assert fresh.entries({**KEY, "model": "x"}) == [] and len(fresh.entries(KEY)) == 1
    assert fresh.counters.n_skipped == 0  # the other key's file is left alone, not counted unreadable
    disk.close()


@pytest.mark.parametrize("damage", ["truncated", "payload", "random", "empty"])
def test_a_damaged_file_is_skipped_and_counted(tmp_path, damage):
    disk = DiskCache(tmp_path, 1)
    written(disk, KEY, state(range(50), n_bytes=5000))
    [path] = tmp_path.glob("*.state")
    raw = bytearray(path.read_bytes())
    if damage == "truncated":
        raw = raw[:-100]
    elif damage == "payload":
        raw[-10] ^= 0xFF
    elif damage == "random":
        raw = bytearray(os.urandom(len(raw)))
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    reader = DiskCache(tmp_path, 1)
    entries = reader.entries(KEY)
    if entries:  # only a flipped payload byte survives the header's checks; the checksum catches it
        assert damage == "payload" and reader.read(entries[0]) is None
    assert reader.counters.n_skipped == 1
    disk.close()


def test_the_budget_evicts_the_least_recently_used(tmp_path):
    disk = DiskCache(tmp_path, 0.05)  # 52 KB: two states of 20 KB
    for i in range(3):
        written(disk, KEY, state([i] * 10, n_bytes=20_000, seed=i))
        time.sleep(0.02)  # distinct mtimes
    assert sorted(e.tokens[0] for e in disk.entries(KEY)) == [1, 2]
    disk.read(next(e for e in disk.entries(KEY) if e.tokens[0] == 1))  # used: now the newest
    time.sleep(0.02)
    written(disk, KEY, state([3] * 10, n_bytes=20_000, seed=3))
    assert sorted(e.tokens[0] for e in disk.entries(KEY)) == [1, 3]
    assert sum(p.stat().st_size for p in tmp_path.glob("*.state")) <= 0.05 * 2**20
    disk.close()


def test_a_state_another_file_extends_is_not_written_and_one_it_extends_is_replaced(tmp_path):
    disk = DiskCache(tmp_path, 1)
    written(disk, KEY, state(range(100), row=False))
    written(disk, KEY, state(range(50), row=False))  # all of it is in the first file
    assert [e.n_tokens for e in disk.entries(KEY)] == [100]
    written(disk, KEY, state(range(200), row=False))
    assert [e.n_tokens for e in disk.entries(KEY)] == [200]
    disk.close()


def test_folder_and_budget_are_checked(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(specllama.InvalidParameterError, match="prompt_cache_dir"):
        DiskCache(blocker / "sub", 1)
    for bad in (0, -1, "10", True):
        with pytest.raises(specllama.InvalidParameterError, match="prompt_cache_disk_mb"):
            DiskCache(tmp_path, bad)


# --- real models ----------------------------------------------------------------------------

def tiny_run(path, folder, prompt=PROMPT, **settings):
    """(the result of generating from prompt on a fresh load, its prompt_cache_info)."""
    with specllama.load(path, prompt_cache_dir=folder, **{**TINY, **settings}) as llm:
        result = llm.generate(prompt, max_tokens=16)
        return result, llm.prompt_cache_info()


def test_a_restart_reuses_the_prompt_from_disk_with_the_same_output(tiny_paths, tmp_path):
    model = tiny_paths["attention-draft"]
    first, _ = tiny_run(model, tmp_path)
    assert first.stats.prompt_cache == "none" and listing(tmp_path)
    again, info = tiny_run(model, tmp_path)
    assert again.stats.prompt_cache == "disk" and again.stats.n_prompt_cached == again.stats.n_prompt
    assert info["target"]["tokens_reused_from_disk"] == again.stats.n_prompt and info["disk"]["read"] == 1
    assert again.tokens == first.tokens


def _other_weights(src, out):
    """A copy of src with other weights in one layer: the same architecture, name and size."""
    import gguf

    shutil.copy(src, out)
    tensor = next(t for t in gguf.GGUFReader(src).tensors if t.name == "blk.1.ffn_down.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0  # blocks of a 2-byte scale and 32 int8
    with open(out, "r+b") as f:
        for block in range(0, tensor.n_bytes, 34):
            f.seek(tensor.data_offset + block + 2)
            f.write(bytes((-x) % 256 for x in f.read(32)[::-1]))
            f.seek(0, 1)
    return out


def _requantized(src, out):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True, 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) == 0
    return out


@pytest.mark.parametrize("variant", ["same-path-other-file", "other-quantization", "other-kv-types",
                                     "other-n-batch"])
def test_a_state_of_another_model_build_or_setting_is_never_loaded(tiny_paths, tmp_path, variant):
    """Written with one model and settings, then asked for by another: a prefill, the output a
    fresh load gives; the same model and settings again find it (so the check can fail)."""
    folder, model = tmp_path / "cache", tmp_path / "model.gguf"
    shutil.copy(tiny_paths["attention-draft"], model)
    tiny_run(model, folder)
    other, settings = model, {}
    if variant == "same-path-other-file":
        _other_weights(tiny_paths["attention-draft"], model)  # same name, place and size, other weights
    elif variant == "other-quantization":  # same name, another folder
        other = _requantized(model, (tmp_path / "q4_0").mkdir() or tmp_path / "q4_0" / "model.gguf")
    elif variant == "other-kv-types":
        settings = dict(type_k="q8_0")
    else:
        settings = dict(n_batch=64)
    got, info = tiny_run(other, folder, **settings)
    assert got.stats.prompt_cache == "none" and info["disk"]["read"] == 0 and info["disk"]["skipped"] == 0
    with specllama.load(other, **{**TINY, **settings}) as fresh:
        assert got.tokens == fresh.generate(PROMPT, max_tokens=16).tokens
    if variant != "same-path-other-file":
        assert tiny_run(model, folder)[0].stats.prompt_cache == "disk"


@pytest.mark.parametrize("damage", ["truncated", "random-bytes"])
def test_a_damaged_file_falls_back_to_a_prefill_with_the_same_output(tiny_paths, tmp_path, damage):
    model = tiny_paths["attention-draft"]
    first, _ = tiny_run(model, tmp_path)
    for path in tmp_path.glob("*.state"):
        n = path.stat().st_size
        path.write_bytes(path.read_bytes()[:n // 2] if damage == "truncated" else os.urandom(n))
    got, info = tiny_run(model, tmp_path)
    assert got.stats.prompt_cache == "none" and info["disk"]["skipped"] >= 1
    assert got.tokens == first.tokens


def test_two_processes_sharing_the_folder_give_correct_outputs(tiny_paths, tmp_path):
    """Two processes, each loading and closing the model on several prompts over one folder, one
    writing while the other reads: every output equals a fresh load's without a folder."""
    model = tiny_paths["attention-draft"]
    prompts = [PROMPT + f"# variant {i}\n" * (i + 1) for i in range(4)]
    script = (
        "import json, sys, specllama\n"
        "model, folder = sys.argv[1], sys.argv[2]\n"
        "prompts, settings = json.loads(sys.argv[3]), json.loads(sys.argv[4])\n"
        "out = []\n"
        "for rep in range(2):\n"
        "    for p in prompts:\n"
        "        with specllama.load(model, prompt_cache_dir=folder, **settings) as llm:\n"
        "            r = llm.generate(p, max_tokens=12)\n"
        "            out.append([p, r.tokens, r.stats.prompt_cache])\n"
        "print(json.dumps(out))\n")
    children = [subprocess.Popen([sys.executable, "-c", script, str(model), str(tmp_path),
                                  json.dumps(prompts[::step]), json.dumps(TINY)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
                for step in (1, -1)]
    outs = []
    for child in children:
        stdout, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, stderr[-2000:]
        outs += json.loads(stdout.splitlines()[-1])
    assert any(source == "disk" for _, _, source in outs)
    with specllama.load(model, **TINY) as fresh:
        expected = {p: fresh.generate(p, max_tokens=12).tokens for p in prompts}
    assert all(tokens == expected[p] for p, tokens, _ in outs)


def test_bitwise_after_a_restart_equals_a_fresh_load_row_for_row(model_paths, tmp_path, monkeypatch):
    """The real pair at the bitwise level: turn 1 in one load (closed: its conversation goes to
    disk), turn 2 in another load that restores it; every logit row of turn 2 equals a fresh
    load's, and so do the tokens."""
    pair = dict(n_draft=3, exact="bitwise", n_batch=CHUNK, **SETTINGS)
    with specllama.load(model_paths["target"], model_paths["draft"], prompt_cache_dir=tmp_path, **pair) as llm:
        first, _ = turns(llm, 1)
    prompt_messages = turns_prompt(first + [None], 1)
    with specllama.load(model_paths["target"], model_paths["draft"], prompt_cache_dir=tmp_path, **pair) as llm:
        warm_rows: dict = {}
        record_rows(monkeypatch, llm.target, warm_rows)
        warm = llm.chat(prompt_messages, max_tokens=N_TOKENS)
        monkeypatch.undo()
        info = llm.prompt_cache_info()
    assert warm.stats.prompt_cache == "disk" and warm.stats.n_prompt_cached >= CHUNK and warm.stats.prompt_cache_exact
    assert info["target"]["restored_from_disk"] == 1
    with specllama.load(model_paths["target"], model_paths["draft"], **pair) as fresh:
        fresh_rows: dict = {}
        record_rows(monkeypatch, fresh.target, fresh_rows)
        expected = fresh.chat(prompt_messages, max_tokens=N_TOKENS)
        monkeypatch.undo()
    assert warm.tokens == expected.tokens
    shared = [k for k in fresh_rows if k in warm_rows]
    assert len(shared) >= N_TOKENS
    assert all(fresh_rows[k] == warm_rows[k] for k in shared), "rows after a restore from disk differ from a fresh load"


def test_the_draft_s_state_comes_back_from_disk_too(tiny_paths, tmp_path):
    """Where the draft drafts (a fixed n_draft with no verify limit), its prompt is prefilled,
    kept at close and restored by the next load beside the target's; same prompt, same output.
    The tiny attention model as target and draft: the mechanics do not depend on the pair."""
    tiny = tiny_paths["attention-draft"]
    runs = []
    for _ in range(2):
        with specllama.load(tiny, tiny, prompt_cache_dir=tmp_path, n_draft=3, exact="off", **TINY) as llm:
            runs.append((llm.generate(PROMPT, max_tokens=12), llm.prompt_cache_info()))
    (first, _), (again, info) = runs
    assert first.stats.n_drafted > 0 and first.stats.n_draft_prompt_cached == 0
    assert info["draft"]["restored_from_disk"] == 1 and again.stats.n_draft_prompt_cached > 0
    assert again.stats.prompt_cache == "disk" and again.tokens == first.tokens


def test_rounding_after_a_restart_differs_from_plain_only_at_counted_near_ties(model_paths, plain, tmp_path):
    messages = conversation(1)[0]
    with specllama.load(model_paths["target"], prompt_cache_dir=tmp_path, **SETTINGS) as llm:
        llm.chat(messages, max_tokens=4)
    with specllama.load(model_paths["target"], prompt_cache_dir=tmp_path, **SETTINGS) as llm:
        got = llm.chat(messages, max_tokens=N_TOKENS)
    assert got.stats.prompt_cache == "disk" and got.stats.n_prompt_cached == got.stats.n_prompt
    expected = plain.chat(messages, max_tokens=N_TOKENS)
    first = first_difference(got.tokens, expected.tokens)
    assert first is None or first in got.stats.near_tie_positions, (first, got.stats.near_tie_positions)


def test_run_twice_with_a_folder_reuses_the_first_run_s_prompt(tiny_paths, tmp_path):
    """specllama run --prompt-cache-dir: the second run of the same prompt prefills nothing."""
    cli = [sys.executable, "-m", "specllama", "run", str(tiny_paths["attention-draft"]), "--draft", "none",
           "--ctx", "512", "--prompt-cache-dir", str(tmp_path), "-n", "4", "--json", "--raw", "-p", PROMPT]
    runs = []
    for _ in range(2):
        out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout))
    assert runs[0]["stats"]["prompt_cache"] == "none" and runs[1]["stats"]["prompt_cache"] == "disk"
    assert runs[1]["stats"]["n_prompt_cached"] == runs[1]["stats"]["n_prompt"]
    assert runs[1]["tokens"] == runs[0]["tokens"]


def test_the_cache_command_lists_and_clears_the_folder(tiny_paths, tmp_path):
    tiny_run(tiny_paths["attention-draft"], tmp_path)
    cli = [sys.executable, "-m", "specllama", "cache", "--prompt-cache-dir", str(tmp_path)]
    shown = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "tiny-attention-draft.gguf" in shown.stdout and "1 state" in shown.stdout
    cleared = subprocess.run(cli + ["--clear"], capture_output=True, text=True, timeout=60)
    assert cleared.returncode == 0 and not list(tmp_path.glob("*.state")), cleared.stderr


# --- the server: a restart, and a stop with a request in flight ----------------------------

def test_a_restarted_server_answers_from_the_disk_cache(tiny_paths, tmp_path):
    """serve --prompt-cache-dir, stopped as a service manager stops it (SIGTERM): the next server
    process finds the conversation on disk; the answer is the first server's."""
    from serving import post, serve

    model, folder = tiny_paths["attention-draft"], tmp_path / "cache"
    body = {"model": "m", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Explain parse()."}]}
    args = ("--draft", "none", "--prompt-cache-dir", str(folder), "--ctx", "512")
    answers = []
    for run in ("first", "restarted"):
        with serve(model, tmp_path / f"{run}.log", *args) as (base, _):
            reply = post(base, "/v1/chat/completions", body)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json())
        assert "Traceback" not in (tmp_path / f"{run}.log").read_text()
    first, again = answers
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"]
    assert again["choices"][0]["message"] == first["choices"][0]["message"]


def test_sigterm_with_a_stream_in_flight_ends_it_and_exits_promptly(tiny_paths, tmp_path):
    """A service manager's stop (SIGTERM, then SIGKILL some seconds later: docker's 10 s) while a
    long answer streams: the stream ends, the process exits within a few seconds, and what the
    conversation computed is on disk."""
    from serving import serve

    import httpx

    folder, started = tmp_path / "cache", []
    body = {"model": "m", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    with serve(tiny_paths["attention-draft"], tmp_path / "serve.log", "--draft", "none", "--ctx", "512",
               "--prompt-cache-dir", str(folder), started=started) as (base, _):
        proc = started[0]
        n_events = 0
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            t_term = None
            for line in reply.iter_lines():
                n_events += line.startswith("data:")
                if n_events == 5 and t_term is None:
                    proc.terminate()
                    t_term = time.monotonic()
        code = proc.wait(timeout=30)
        t_exit = time.monotonic() - t_term
    log = (tmp_path / "serve.log").read_text()
    # uvicorn re-raises the signal once shut down, as a process stopped by SIGTERM should report
    assert code in (0, -signal.SIGTERM) and t_exit < 8, (code, t_exit, log[-2000:])
    assert 5 <= n_events < 400, n_events  # the stream ended with the server, not at max_tokens
    assert "Traceback" not in log, log[-2000:]
    assert listing(folder), "the conversation was not kept on disk at the stop"
