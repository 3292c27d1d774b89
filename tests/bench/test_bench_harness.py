"""bench/_harness.py: the one peak-memory method sees a short peak that is gone before the block ends, and
the one timer counts the CPU of every thread of the process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import _harness  # noqa: E402
import pytest  # noqa: E402


def test_peak_memory_sees_a_freed_peak() -> None:
    size = 64 << 20
    with _harness.PeakMemory() as peak:
        block = bytearray(size)  # zero-filled by the allocator's mmap: touch every page to make it resident
        for i in range(0, size, 4096):
            block[i] = 1
        del block
    assert peak.extra >= size * 0.9
    with _harness.PeakMemory() as quiet:
        pass
    assert quiet.extra < size // 2


def test_timer_counts_every_thread() -> None:
    """The process's CPU time covers what each worker thread measured of its own (its thread CPU clock, in
    the same run). A ratio to a separate one-thread run (> 1.5x) failed beside two busy loops: the CPU time
    of the same 0.07 s of work differs from run to run there."""
    own: list[float] = []

    def spin() -> None:
        began = time.thread_time()
        n = 0
        for i in range(3_000_000):
            n += i
        own.append(time.thread_time() - began)

    def two_threads() -> None:
        threads = [threading.Thread(target=spin) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    wall, cpu = _harness.timed(two_threads)
    assert len(own) == 2 and all(t > 0 for t in own)
    # A timer blind to other threads reports the main thread's waiting: next to nothing.
    assert wall > 0 and cpu >= 0.99 * sum(own), (cpu, own)
    assert _harness.wall(spin) > 0


def test_interleave_rotates_within_heats_and_reverses_heats() -> None:
    got = [(r, i, c) for r, i, c in _harness.interleave([["a1", "a2"], ["b1", "b2", "b3"]], 2)]
    assert got == [(0, 0, "a1"), (0, 0, "a2"), (0, 1, "b1"), (0, 1, "b2"), (0, 1, "b3"),
                   (1, 0, "b2"), (1, 0, "b3"), (1, 0, "b1"), (1, 1, "a2"), (1, 1, "a1")]


def test_spread_and_median_range() -> None:
    assert _harness.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert _harness.median_range([1.0, 4.0, 2.0]) == "2.00 (1.00–4.00)"
    assert _harness.median_range([]) == "—"
    try:
        _harness.spread([])
    except ValueError as exc:
        assert "no samples" in str(exc)
    else:
        raise AssertionError("spread of nothing must raise")


def test_evict_tree_leaves_no_page_cached(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for name in ("a.bin", "d/b.bin"):
        (tmp_path / name).write_bytes(b"x" * (1 << 20))  # written through the cache: resident now
    from deepnvme.tools.pagecache import cached_pages

    assert cached_pages(tmp_path / "a.bin") > 0
    assert _harness.evict_tree(tmp_path, tmp_path / "missing") == 0
    assert cached_pages(tmp_path / "d" / "b.bin") == 0


# What each child below measures with: its resident anonymous memory, from the harness.
CHILD_PRELUDE = """
import sys
sys.path.insert(0, {bench!r})
import _harness
def anon():
    return _harness.status_bytes("RssAnon")["RssAnon"]
"""


def run_child(code: str) -> str:
    """stdout of `code` run after CHILD_PRELUDE in a new interpreter, clean of anything in the environment
    that sets the allocator."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    prelude = CHILD_PRELUDE.format(bench=str(ROOT / "bench"))
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, check=True,
                          env=env).stdout


# In a child: 20 MiB allocated, filled and freed (which raises glibc's own threshold to 20 MiB), then the
# threshold fixed (or not), then three blocks of 16 MiB: how much each grew RssAnon, and kept of it freed.
FREED_AGAIN = """
import torch
torch.empty(20 << 20, dtype=torch.uint8).fill_(1)
fixed = _harness.large_allocations_new() if {fix} else None
grew, kept = [], []
for _ in range(3):
    before = anon()
    t = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
    grew.append(anon() - before)
    del t
    kept.append(anon() - before)
print(fixed, min(grew), max(kept))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator and its mallopt")
@pytest.mark.parametrize("fix", [False, True])
def test_large_allocations_are_new_memory_once_the_threshold_is_fixed(fix: bool) -> None:
    """Once glibc has raised its threshold past 16 MiB, a 16 MiB block freed stays in its heap, its pages
    made, for the next to reuse; after large_allocations_new, every next block is new memory (RssAnon
    grows by it when it is filled) and goes back to the kernel when freed. Run clean of anything that sets
    the allocator."""
    out = run_child(FREED_AGAIN.format(fix=fix)).split()
    grew, kept = int(out[1]), int(out[2])
    if fix:
        assert out[0] == "True"
        assert grew >= 15 << 20 and kept < 1 << 20
    else:  # which block of the three reuses the heap's pages varies; that each freed one stays does not
        assert kept >= 15 << 20


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator and its malloc_trim")
def test_release_freed_hands_the_heaps_free_pages_back() -> None:
    """Small blocks freed stay in glibc's heap; release_freed gives their pages back to the kernel."""
    out = run_child("""
_harness.large_allocations_new()
keep = []
blocks = [bytearray(100 << 10) for _ in range(400)]  # 40 MB of heap blocks under the threshold
keep.append(bytearray(100 << 10))  # a live heap block above them: the top cannot shrink past it
del blocks
before = anon()
_harness.release_freed()
print(before - anon())
""")
    assert int(out) >= 30 << 20
