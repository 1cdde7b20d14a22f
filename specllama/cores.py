"""How much of this process's cores other processes use (Linux: /proc/stat). llama.cpp's
threads wait for each other at every step, so one thread without a core of its own stalls them
all: a measurement or a benchmark taken while other processes hold the cores times them too."""

from __future__ import annotations

import os
import time
from typing import Optional

SPARE_CORES = 0.5  # other processes may use this much of the cores our threads need, beyond those left over


def busy_jiffies(proc_stat: str, cpus: set[int]) -> int:
    """Clock ticks the CPUs in cpus spent busy (all but idle and iowait; steal counts as busy: the
    hypervisor ran something else there), from the text of /proc/stat."""
    total = 0
    for line in proc_stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks) - ticks[3] - ticks[4]
    return total


class OtherProcesses:
    """Other processes' use of the cores this process may run on, from its making to a read.
    Where it cannot be read (no /proc/stat: not Linux) every read says None."""

    def __init__(self) -> None:
        try:
            self._cpus = os.sched_getaffinity(0)
            self._hz = os.sysconf("SC_CLK_TCK")
            self._start: Optional[tuple[float, int, float]] = self._sample()
        except (AttributeError, OSError, ValueError):
            self._start = None

    @property
    def n_cores(self) -> int:
        return len(self._cpus) if self._start is not None else os.cpu_count() or 1

    def _sample(self) -> tuple[float, int, float]:
        with open("/proc/stat") as f:
            return time.monotonic(), busy_jiffies(f.read(), self._cpus), sum(os.times()[:2])

    def cores(self) -> Optional[float]:
        """The cores they used on average so far (this process's own threads left out)."""
        if self._start is None:
            return None
        try:
            t1, busy1, own1 = self._sample()
        except (OSError, ValueError):
            return None
        t0, busy0, own0 = self._start
        return max(0.0, (busy1 - busy0) / self._hz - (own1 - own0)) / max(t1 - t0, 1e-6)

    def excess(self, n_threads: int, used: Optional[float] = None) -> Optional[float]:
        """How much of the cores n_threads need they took (0: those cores were free), in cores;
        used: a reading of cores() to judge (default: a new one)."""
        used = self.cores() if used is None else used
        if used is None:
            return None
        return max(0.0, used - (len(self._cpus) - min(n_threads, len(self._cpus))))


def cores_used_by_others(n_threads: int, window: float = 0.25) -> Optional[float]:
    """OtherProcesses' excess over a window from now (None: not readable here)."""
    others = OtherProcesses()
    time.sleep(window)
    return others.excess(n_threads)
