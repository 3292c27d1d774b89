"""What every bench script measures with: one clock, one CPU count, one peak-memory method, one order of
interleaved repeats, one way to summarise samples and to start a read from a cold cache.

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

import ctypes
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's deepnvme, not an installed one

__all__ = ["MMAP_THRESHOLD", "ROOT", "PeakMemory", "children_cpu", "cpu_self", "evict_tree", "interleave",
           "large_allocations_new", "median_range", "release_freed", "spread", "status_bytes", "timed",
           "wall"]

T = TypeVar("T")

# glibc's starting mmap threshold: allocations this large or larger get mappings of their own when its heap
# has no free space for them. glibc raises the threshold (up to 32 MiB) each time such a mapping is freed,
# and from then on keeps allocations that large in its heap, whose freed memory it reuses.
MMAP_THRESHOLD = 128 * 1024


def _libc() -> Any:
    """This process's C library (dlopen of the process itself: cheap, and the same handle each time)."""
    return ctypes.CDLL(None)


def large_allocations_new() -> bool:
    """From now on, allocations of MMAP_THRESHOLD bytes or more in this process are not served from memory
    glibc kept after freeing them (unless free heap space below its top fits them: see release_freed):
    glibc's threshold is fixed (mallopt M_MMAP_THRESHOLD, which also stops its adjustment). Why: a bench
    process loads checkpoints over and over, and once glibc has raised its threshold, later loads find
    memory that earlier ones freed, its pages already made, so their figures would depend on what ran
    before. False where the C library has no mallopt or refuses (not glibc)."""
    mallopt = getattr(_libc(), "mallopt", None)
    m_mmap_threshold = -3
    return bool(mallopt is not None and mallopt(m_mmap_threshold, MMAP_THRESHOLD) == 1)


def release_freed() -> None:
    """Hand the heap's freed pages back to the kernel (glibc's malloc_trim), so that no later allocation,
    large or small, finds memory an earlier one made; nothing where the C library lacks it."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


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


def greedy_steps(model: Any, nxt: Any, cache: Any, tokens: int) -> tuple[list[float], list[Any]]:
    """`tokens` greedy decode steps of a Hugging Face causal LM (transformers 5: `cache=`, `out.cache`)
    from `nxt`, the last token of each sequence, with its KV cache `cache`, each step timed alone: (seconds
    of each step, the [batch, 1] tokens chosen, in order). Call under torch.inference_mode()."""
    steps: list[float] = []
    made: list[Any] = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(time.perf_counter() - t0)
        cache = out.cache
        made.append(nxt)
    return steps, made


def interleave(heats: Sequence[Sequence[T]], repeats: int) -> Iterator[tuple[int, int, T]]:
    """``(repeat, position of its heat in this repeat, contender)`` for every run of an interleaved bench.

    A heat is a group of contenders measured back to back (the same size, the same setting). Within a heat
    the order rotates by one every repeat, so that nobody always goes first (after a rest, on a cold disk
    allowance) or always follows the same neighbour; the heats run in an order that reverses every repeat,
    so that a load which drifts over the run does not always land on the same heat.
    """
    for r in range(repeats):
        order = heats if r % 2 == 0 else heats[::-1]
        for i, heat in enumerate(order):
            k = r % len(heat) if heat else 0
            for contender in [*heat[k:], *heat[:k]]:
                yield r, i, contender


def spread(values: Iterable[float]) -> dict[str, float]:
    """Median, min and max of the samples (``n`` too): what every table cell shows."""
    got = sorted(values)
    if not got:
        raise ValueError("spread of no samples")
    return {"median": statistics.median(got), "min": got[0], "max": got[-1], "n": len(got)}


def median_range(values: Iterable[float], digits: int = 2) -> str:
    """``median (min–max)`` of the samples, or ``—`` when there are none."""
    got = list(values)
    if not got:
        return "—"
    s = spread(got)
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def evict_tree(*paths: str | os.PathLike[str]) -> int:
    """Flush and drop from the page cache every file at or under ``paths`` (fdatasync + fadvise, no root
    needed: deepnvme.tools.pagecache), so the next read comes from the drive. Returns how many pages of them
    the cache still holds afterwards (mincore): 0 when the eviction worked, which a bench should report."""
    from deepnvme.tools.pagecache import cached_pages, drop_file_cache

    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += [f for f in p.rglob("*") if f.is_file() and not f.is_symlink()]
        elif p.is_file():
            files.append(p)
    for f in files:
        drop_file_cache(str(f))
    return sum(cached_pages(f) for f in files)
