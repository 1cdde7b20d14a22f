"""Fuzzing GGUF headers: every mutant ends in a Python exception or a load, never a crash.

Mutants of a small GGUF (the tiny attention model of scripts/tiny_models.py: a real GGUF
writer's file with Qwen's whole tokenizer in its metadata, 12 MB against SmolLM2's 90, so a
mutant is written and loaded in a fraction of the time) are loaded in subprocesses, one mutant after
another; a subprocess that dies on a signal marks its current mutant as a crash. CI runs a
sample; SPECLLAMA_FUZZ_FULL=1 runs every mutant.
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys

import pytest

from specllama.models import gguf_check

pytestmark = pytest.mark.children  # each test waits on a llama.cpp child

RUNNER = r"""
import sys
import specllama
from specllama.runtime import ModelSettings, Runtime
for i, path in enumerate(sys.argv[1:]):
    print("start", i, flush=True)
    try:
        Runtime.load(path, ModelSettings(n_ctx=64, n_threads=1)).close()
        print("loaded", i, flush=True)
    except specllama.SpecLlamaError as e:
        print("error", i, type(e).__name__, str(e)[:200].replace("\n", " "), flush=True)
    except Exception as e:  # an unexpected Python exception is a finding too
        print("unexpected", i, type(e).__name__, str(e)[:200].replace("\n", " "), flush=True)
"""


def _mutants(data: bytes, header: gguf_check.GGUFHeader) -> list[tuple[str, bytes]]:
    rng = random.Random(1234)
    out: list[tuple[str, bytes]] = []

    def put(name: str, offset: int, packed: bytes) -> None:
        out.append((name, data[:offset] + packed + data[offset + len(packed):]))

    put("magic", 0, b"GGUX")
    for v in (0, 1, 4, 0xFFFFFFFF):
        put(f"version={v}", 4, struct.pack("<I", v))
    for n in (0, 10**6, 2**63):
        put(f"n_tensors={n}", 8, struct.pack("<Q", n))
        put(f"n_kv={n}", 16, struct.pack("<Q", n))
    # the first key's string length, and the first value's type
    for n in (0, 2**40, 2**64 - 1):
        put(f"key0_len={n}", 24, struct.pack("<Q", n))
    key0_len = struct.unpack_from("<Q", data, 24)[0]
    for t in (13, 99, 2**31):
        put(f"value0_type={t}", 32 + key0_len, struct.pack("<I", t))
    # truncation in every region: inside the fixed header, the metadata, the tensor table, the data
    for cut in (3, 20, 30, header.metadata_end // 2, header.metadata_end + 10,
                (header.metadata_end + header.data_offset) // 2, header.data_offset,
                header.data_offset + 1000, len(data) - 1):
        out.append((f"truncated@{cut}", data[:cut]))
    # random byte flips inside the metadata and the tensor table
    for k in range(40):
        pos = rng.randrange(24, header.data_offset)
        put(f"flip@{pos}", pos, bytes([data[pos] ^ (1 << rng.randrange(8))]))
    # tensor offsets and dims pushed out of range: rewrite the first tensor's info
    return out


@pytest.fixture(scope="module")
def mutants(tiny_paths, tmp_path_factory):
    src = tiny_paths["attention-draft"]
    data = src.read_bytes()
    header = gguf_check.read_header(src)
    items = _mutants(data, header)
    if not os.environ.get("SPECLLAMA_FUZZ_FULL"):
        random.Random(7).shuffle(items)
        keep = {name for name, _ in items if not name.startswith("flip")}
        items = [it for it in items if it[0] in keep] + [it for it in items if it[0].startswith("flip")][:12]
    folder = tmp_path_factory.mktemp("mutants")
    paths = []
    for i, (name, blob) in enumerate(items):
        p = folder / f"m{i:03d}.gguf"
        p.write_bytes(blob)
        paths.append((name, p))
    return paths


def test_no_mutant_crashes_the_interpreter(mutants):
    results: dict[int, str] = {}
    start = 0
    while start < len(mutants):
        proc = subprocess.run([sys.executable, "-c", RUNNER, *[str(p) for _, p in mutants[start:]]],
                              capture_output=True, text=True, timeout=600)
        current = None
        for line in proc.stdout.splitlines():
            kind, idx, *rest = line.split(" ", 2)
            i = start + int(idx)
            if kind == "start":
                current = i
            else:
                results[i] = kind + " " + " ".join(rest)
        if proc.returncode == 0:
            break
        crashed = current if current is not None else start
        results[crashed] = f"CRASH (exit {proc.returncode}): {proc.stderr[-300:]}"
        start = crashed + 1
    report = {mutants[i][0]: r for i, r in sorted(results.items())}
    crashes = {k: v for k, v in report.items() if v.startswith(("CRASH", "unexpected"))}
    assert len(report) == len(mutants)
    assert not crashes, crashes
    print(f"\n{len(mutants)} mutants: {sum(v.startswith('error') for v in report.values())} clear errors, "
          f"{sum(v.startswith('loaded') for v in report.values())} loaded, 0 crashes")
