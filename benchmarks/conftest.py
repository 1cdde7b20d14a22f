"""Benchmark fixtures: real models, a summary table at the end, saved as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS: list[dict] = []
SUMMARY_PATH = ROOT / ".benchmarks" / "summary.json"


sys.path.insert(0, str(ROOT / "scripts"))
import fetch_models  # noqa: E402  (a script, so not importable as a package)


@pytest.fixture(scope="session")
def bench_models() -> dict[str, Path]:
    return {name: fetch_models.path_of(name) for name in ("target", "target-f16", "draft")}


def record(row: dict) -> None:
    RESULTS.append(row)


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("specllama speedups (ratio to plain decoding measured in the same run)")
    header = f"{'target':6} {'workload':8} {'config':12} {'tok/s':>7} {'plain':>7} {'speedup':>8} " \
             f"{'accept':>7} {'tok/round':>9} {'overhead':>9} {'same':>5}"
    tr.write_line(header)
    for r in RESULTS:
        tr.write_line(f"{r['target']:6} {r['workload']:8} {r['config']:12} {r['tokens_per_s']:7.1f} "
                      f"{r['plain_tokens_per_s']:7.1f} {r['speedup']:7.2f}x {r['acceptance']:7.0%} "
                      f"{r['tokens_per_round']:9.2f} {r['overhead_share']:8.1%} {str(r['identical']):>5}")
    SUMMARY_PATH.parent.mkdir(exist_ok=True)
    SUMMARY_PATH.write_text(json.dumps(RESULTS, indent=1))
    tr.write_line(f"saved {SUMMARY_PATH}")
