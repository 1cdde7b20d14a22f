"""`bench --plot` and `doctor --plot`: what decides a draft's worth on this machine, drawn with
matplotlib (an optional extra: pip install -e '.[plot]').

Three panels: the target's measured decode time by batch rows (the verify-cost curve) beside
a draft token's, the share of drafted tokens the target kept at each draft position, and the
speed against draft length: measured (bench) beside what the costs allow were every draft kept
((k + 1) target steps' worth of tokens for k draft steps and one verify of k + 1 rows)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from .controller import Costs
from .controller.costs import ideal_speedup

N_ROWS = 16  # the verify batches drawn
EXTRA = "pip install -e '.[plot]' (matplotlib)"


def missing() -> Optional[str]:
    """What to install when matplotlib is missing (checked before anything loads), else None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"drawing needs matplotlib: {EXTRA}"
    return None


def acceptance_by_position(drafted_at: Sequence[int], accepted_at: Sequence[int]) -> list[float]:
    """The share kept of the tokens drafted at each position (Stats.drafted_at, accepted_at)."""
    return [a / d if d else 0.0 for d, a in zip(drafted_at, accepted_at)]


def draw(path: Path, title: str, costs: Costs, acceptance: Optional[Sequence[float]] = None,
         speedups: Optional[dict[int, float]] = None, k_max: int = 8) -> None:
    """A PNG at path: the cost curve, the acceptance by position (if measured) and the speedup
    against draft length (measured points, if given, beside the costs' ideal)."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    panels = 3 if acceptance is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), constrained_layout=True)
    fig.suptitle(title)
    _cost_curve(axes[0], costs)
    if acceptance is not None:
        _acceptance(axes[1], acceptance)
    _speed(axes[-1], costs, speedups, k_max)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cost_curve(ax: Any, costs: Costs) -> None:
    rows = list(range(1, N_ROWS + 1))
    ax.plot(rows, [costs.v(n) * 1000 for n in rows], marker="o", label="target: one decode of n rows")
    ax.axhline(costs.draft_token * 1000, color="tab:green", linestyle="--", label="draft: one token")
    ax.set_xlabel("rows in the batch (verify: drafted tokens + 1)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title("decode time by batch size")
    ax.legend()


def _acceptance(ax: Any, acceptance: Sequence[float]) -> None:
    positions = list(range(1, len(acceptance) + 1))
    ax.bar(positions, [a * 100 for a in acceptance], color="tab:green")
    ax.set_xlabel("draft position")
    ax.set_ylabel("% of drafted tokens kept")
    ax.set_ylim(0, 100)
    ax.set_title("acceptance by position")


def _speed(ax: Any, costs: Costs, speedups: Optional[dict[int, float]], k_max: int) -> None:
    ks = list(range(0, k_max + 1))
    ax.plot(ks, [ideal_speedup(costs, k) for k in ks], linestyle="--", color="gray",
            label="every draft kept (from the costs)")
    if speedups:
        measured = sorted(speedups.items())
        ax.plot([k for k, _ in measured], [s for _, s in measured], marker="o", color="tab:blue", label="measured")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("tokens drafted per round")
    ax.set_ylabel("speed against plain decoding (x)")
    ax.set_ylim(bottom=0)
    ax.set_title("speed against draft length")
    ax.legend()
