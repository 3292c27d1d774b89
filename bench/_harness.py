"""What every bench script measures with: one clock, one CPU count, one peak-memory method.

Importing it also puts this checkout first on ``sys.path``, so a bench run from bench/ measures this tree's
deepnvme, not an installed one.

The clock: ``time.perf_counter`` for wall seconds, and this process's user+system CPU seconds (all its
threads) from ``getrusage``, read around the measured call only.

Peak memory: the kernel's resident high-water mark. Writing 5 to ``/proc/self/clear_refs`` resets
``VmHWM`` to the current resident size; ``VmHWM`` after the block minus ``VmRSS`` before it is the block's
peak extra memory. It is exact, where sampling the resident size from a thread misses any peak shorter than
its period and spends a core's share on the sampling itself, which the measured code then competes with.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's deepnvme, not an installed one

__all__ = ["ROOT", "PeakMemory", "children_cpu", "cpu_self", "status_bytes", "timed", "wall"]


def cpu_self() -> float:
    """User+system CPU seconds of this process (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def children_cpu() -> float:
    """User+system CPU seconds of this process's reaped children (fio, compilers)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU seconds of fn() in this process."""
    c0, t0 = cpu_self(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_self() - c0


def wall(fn: Callable[[], Any]) -> float:
    """Wall seconds of fn() alone: for calls of microseconds, where reading CPU time would cost about as
    much as the call itself."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def status_bytes(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status given in kB (VmRSS, VmHWM, ...), in bytes."""
    text = Path("/proc/self/status").read_text()
    found = {k: re.search(rf"^{k}:\s+(\d+)", text, re.M) for k in keys}
    missing = [k for k, m in found.items() if not m]
    if missing:
        raise RuntimeError(f"no {', '.join(missing)} in /proc/self/status")
    return {k: int(m.group(1)) * 1024 for k, m in found.items() if m}


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.extra``: the block's peak resident bytes above the start."""

    extra: int = 0

    def __enter__(self) -> PeakMemory:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start = status_bytes("VmRSS")["VmRSS"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.extra = status_bytes("VmHWM")["VmHWM"] - self.start
