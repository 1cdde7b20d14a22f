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


def rate(stats) -> float:
    """Tokens per second after the target's prefill, the draft's prefill counted."""
    seconds = stats.t_decode + stats.t_draft_prefill
    return (stats.n_generated - 1) / seconds if stats.n_generated > 1 and seconds > 0 else 0.0


def record(row: dict) -> None:
    RESULTS.append(row)


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("specllama speedups (median ratio to plain decoding in the same run)")
    configs = [key[len("speedup "):] for key in RESULTS[0] if key.startswith("speedup ")]
    tr.write_line(f"{'target':6} {'workload':8} {'mode':7} {'plain':>6} " + " ".join(f"{c:>6}" for c in configs)
                  + f" {'best':>6} {'auto/best':>9} {'accept':>6} {'lookup':>6} {'tree':>4} {'ties':>4}")
    for r in RESULTS:
        tr.write_line(f"{r['target']:6} {r['workload']:8} {r.get('mode', 'greedy'):7} {r['plain_tokens_per_s']:6.1f} "
                      + " ".join(f"{r['speedup ' + c]:5.2f}x" for c in configs)
                      + f" {r['best_single']:>6} {r['auto_vs_best']:8.2f}x {r['auto_acceptance']:6.0%}"
                      f" {r['auto_lookup_rounds']:6} {r.get('auto_tree_rounds', 0):4} {r['auto_near_ties'] or 0:4}")
    SUMMARY_PATH.parent.mkdir(exist_ok=True)
    SUMMARY_PATH.write_text(json.dumps(RESULTS, indent=1, default=str))
    tr.write_line(f"saved {SUMMARY_PATH}")
