"""How much of this process's cores other processes use (Linux: /proc/stat, the CPUs this
process may run on; macOS: the kernel's CPU load ticks over all cores). llama.cpp's threads wait
for each other at every step, so one thread without a core of its own stalls them all: a
measurement or a benchmark taken while other processes hold the cores times them too."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from typing import Callable, Optional

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


@functools.lru_cache(maxsize=1)
def _mach_host_statistics() -> tuple[ctypes.CDLL, int]:
    libc = ctypes.CDLL("/usr/lib/libSystem.dylib")
    libc.mach_host_self.restype = ctypes.c_uint
    libc.host_statistics.argtypes = [ctypes.c_uint, ctypes.c_int, ctypes.POINTER(ctypes.c_uint),
                                     ctypes.POINTER(ctypes.c_uint)]
    libc.host_statistics.restype = ctypes.c_int
    return libc, libc.mach_host_self()


def _mach_busy_ticks() -> Callable[[], int]:
    """macOS: a reader of the clock ticks all CPUs spent busy (user, system, nice: all but idle),
    from the kernel's HOST_CPU_LOAD_INFO, as top reads them. Its counters are 32-bit and wrap
    (a 24-core machine in about 20 days), so the reader adds up differences modulo 2**32."""
    libc, host = _mach_host_statistics()
    last: list[int] = []
    total = 0

    def read() -> int:
        nonlocal last, total
        ticks, count = (ctypes.c_uint * 4)(), ctypes.c_uint(4)  # user system idle nice
        if libc.host_statistics(host, 3, ticks, ctypes.byref(count)) != 0:  # 3: HOST_CPU_LOAD_INFO
            raise OSError("host_statistics(HOST_CPU_LOAD_INFO) failed")
        busy = [ticks[0], ticks[1], ticks[3]]
        if last:
            total += sum((b - a) % 2 ** 32 for a, b in zip(last, busy))
        last = busy
        return total
    return read


def _proc_stat_busy_ticks(cpus: set[int]) -> Callable[[], int]:
    def read() -> int:
        with open("/proc/stat") as f:
            return busy_jiffies(f.read(), cpus)
    return read


class OtherProcesses:
    """Other processes' use of the cores this process may run on, from its making to a read.
    Where it cannot be read (neither Linux nor macOS) every read says None."""

    def __init__(self) -> None:
        self._start: Optional[tuple[float, int, float]] = None
        try:
            if sys.platform == "darwin":
                self._cpus = set(range(os.cpu_count() or 1))  # no affinity there: every core
                self._busy_ticks = _mach_busy_ticks()
            else:
                self._cpus = os.sched_getaffinity(0)
                self._busy_ticks = _proc_stat_busy_ticks(self._cpus)
            self._hz = os.sysconf("SC_CLK_TCK")
            self._start = self._sample()
        except (AttributeError, OSError, ValueError):
            self._start = None

    @property
    def n_cores(self) -> int:
        return len(self._cpus) if self._start is not None else os.cpu_count() or 1

    def _sample(self) -> tuple[float, int, float]:
        return time.monotonic(), self._busy_ticks(), sum(os.times()[:2])

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


class OthersArrive:
    """stop() for work that leaves the cores to other processes: true once other processes took
    more than SPARE_CORES of the cores n_threads need over the last window (one read of the
    counters per window, however often it is called). Idle work starts only while the cores are
    free, and ran a 4-8 s probe to its end even when another process started decoding in it:
    both then ran at half speed, and the other one's timings said so."""

    def __init__(self, n_threads: int, window: float = 0.25):
        self._n_threads, self._window = n_threads, window
        self._others, self._since = OtherProcesses(), time.monotonic()
        self.arrived = False  # it said so

    def __call__(self) -> bool:
        if time.monotonic() - self._since < self._window:
            return False
        excess = self._others.excess(self._n_threads)
        self._others, self._since = OtherProcesses(), time.monotonic()
        self.arrived = self.arrived or (excess is not None and excess > SPARE_CORES)
        return self.arrived


def cores_used_by_others(n_threads: int, window: float = 0.25) -> Optional[float]:
    """OtherProcesses' excess over a window from now (None: not readable here)."""
    others = OtherProcesses()
    time.sleep(window)
    return others.excess(n_threads)
