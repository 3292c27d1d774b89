"""bench/_harness.py: the one peak-memory method sees a short peak that is gone before the block ends, and
the one timer counts the CPU of every thread of the process."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import _harness  # noqa: E402


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
    def spin() -> None:
        n = 0
        for i in range(3_000_000):
            n += i

    def two_threads() -> None:
        threads = [threading.Thread(target=spin) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    wall, cpu = _harness.timed(two_threads)
    _, one = _harness.timed(spin)
    assert wall > 0 and cpu > one * 1.5  # two threads' work, whatever the wall time
    assert _harness.wall(spin) > 0
