"""The main job in one command: a tensor written and read through aio_handle, beside torch.save/torch.load.

    deepnvme demo --size 1G [--dir DIR] [--repeats N] [--rest SECONDS]   (also python3 -m deepnvme demo ...)

Each contender runs `--repeats` times, interleaved (the order alternates from one repeat to the next) with a
rest before every timed step; the table gives the median and the range. Reads start cold: the file's pages
are dropped from the page cache (and the drop is checked). Below the table the demo says when the figures
are not to be trusted: a virtual disk whose host may cache it, a page cache it could not drop, reads at
memory speed, figures that swing between repeats, or other work on the CPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from deepnvme._core.handles import RECOMMENDED
from deepnvme.filesystem import fsync_path
from deepnvme.tools.ownership import banner
from deepnvme.tools.pagecache import (
    CACHED,
    DESCRIPTIONS,
    cached_pages,
    drop_all_caches,
    drop_file_cache,
    read_mode,
)
from deepnvme.tools.pattern import fill_pattern
from deepnvme.tools.sizes import parse_size
from deepnvme.tools.trust import CpuClock, virtual_disk

AIO, TORCH = "deepnvme aio_handle", "torch.save / torch.load"

# When to doubt the figures. A read within this fraction of a plain memory copy came from memory, whatever
# was dropped; repeats whose slowest and fastest differ by more than SPREAD measured different things; other
# work using BUSY_SHARE of the CPUs (at least BUSY_MIN of them) while the demo rested competed with it.
MEMORY_SPEED = 0.5
SPREAD = 1.5
BUSY_SHARE, BUSY_MIN = 0.25, 0.5


def _human(n: int) -> str:
    """A size for people: 1 GiB, 4 MiB, 1000001 bytes."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.4g} {name}"
    return f"{n} bytes"


def _summary(rates: list[float]) -> str:
    """'median (min-max)' in GB/s."""
    return f"{statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f})"


class _Run:
    """The timed steps of one demo run and what was seen around them (rests, cache drops)."""

    def __init__(self, rest: float, mode: str) -> None:
        self.rest = rest
        self.in_memory = mode == CACHED
        self.clock = CpuClock()
        self.busy_while_resting: list[float] = []
        self.undropped: list[str] = []  # files whose pages stayed cached after the drop
        self.root_drop = os.geteuid() == 0

    def pause(self) -> None:
        """Rest (the drive finishes background work) and measure what else used the CPUs meanwhile."""
        self.clock.busy_cpus()
        time.sleep(self.rest)
        self.busy_while_resting.append(self.clock.busy_cpus())

    def timed(self, step: Callable[[], object]) -> float:
        """Seconds one step took, after a rest."""
        self.pause()
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    def make_cold(self, path: str) -> None:
        """Drop the file's pages; with root, the whole page cache if the file's pages would not go (unless
        the file lives in memory, where no drop can help)."""
        drop_file_cache(path)
        left = cached_pages(path)
        if left and self.root_drop and not self.in_memory:
            drop_all_caches()
            left = cached_pages(path)
        if left:
            self.undropped.append(f"{os.path.basename(path)}: {left} pages still cached")


def _memory_copy_rate(data, back) -> float:
    """GB/s of a plain copy between the demo's two tensors (best of three, their pages already touched):
    the speed of memory here."""
    back.zero_()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        back.copy_(data)
        best = min(best, time.perf_counter() - start)
    return data.numel() / best / 1e9


def _doubts(run: _Run, mode: str, directory: str, reads: dict[str, list[float]],
            writes: dict[str, list[float]], memory_rate: float) -> list[str]:
    """Why the figures may not be the drive's (empty when nothing says so)."""
    doubts = []
    disk = virtual_disk(directory)
    if disk:
        doubts.append(f"virtual disk: {disk}; cold reads may not reach a drive")
    if mode == CACHED:
        doubts.append(f"page cache: {directory} is in memory (tmpfs/ramfs): nothing is read from a drive")
    if run.undropped:
        why = "" if run.root_drop else " (not root: /proc/sys/vm/drop_caches unused)"
        doubts.append(f"page cache could not be dropped ({'; '.join(run.undropped)}){why}: reads include "
                      "cached data")
    for name, rates in reads.items():
        if statistics.median(rates) >= MEMORY_SPEED * memory_rate:
            doubts.append(f"{name} read at {statistics.median(rates):.2f} GB/s, near memory speed here "
                          f"({memory_rate:.2f} GB/s copy): served from a cache, not the drive")
    for kind, table in (("write", writes), ("read", reads)):
        for name, rates in table.items():
            if len(rates) > 1 and max(rates) > SPREAD * min(rates):
                doubts.append(f"{name} {kind} swings {min(rates):.2f}-{max(rates):.2f} GB/s between repeats "
                              f"(more than {SPREAD}x): run again, with more --repeats")
    cpus = os.cpu_count() or 1
    busy = statistics.median(run.busy_while_resting) if run.busy_while_resting else 0.0
    load = os.getloadavg()[0]
    if busy >= max(BUSY_MIN, BUSY_SHARE * cpus) or load > 0.75 * cpus:
        doubts.append(f"busy CPU: other work kept {busy:.1f} of {cpus} CPUs busy while the demo rested "
                      f"(load average {load:.1f}): it competes for the CPUs and memory the copies need")
    return doubts


def run(size: int, directory: str, repeats: int = 3, rest: float = 0.5) -> int:
    """Write and read `size` bytes with deepnvme and with torch, `repeats` times interleaved; print GB/s
    (median and range) and why not to trust them, if anything says so; 0 when the data round-trips."""
    import torch

    from deepnvme import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    handle = aio.aio_handle(**RECOMMENDED)  # the library's own, untuned for this drive
    mode = read_mode(directory)
    gb = size / 1e9
    print(f"engine: {handle.get_engine()} (available: {', '.join(aio.available_engines())})")
    print(f"settings: block 1 MiB, queue depth 32, overlap_events, 2 threads; {_human(size)} "
          f"in {directory}")
    print(f"reads: {DESCRIPTIONS[mode]}")
    print(f"repeats: {repeats}, interleaved, {rest:g} s rest before each step")

    try:
        data = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        kind = "locked"
    except (MemoryError, OSError, RuntimeError) as exc:
        data = torch.empty(size, dtype=torch.uint8)  # plain tensors run at full speed too
        kind = f"plain (locking failed: {exc})"
    print(f"tensor: {kind}")
    fill_pattern(data)
    back = torch.empty(size, dtype=torch.uint8)
    memory_rate = _memory_copy_rate(data, back)

    fd, aio_path = tempfile.mkstemp(prefix="deepnvme_demo_", suffix=".bin", dir=directory)
    os.close(fd)
    pt_path = aio_path[:-4] + ".pt"
    demo = _Run(rest, mode)
    writes: dict[str, list[float]] = {AIO: [], TORCH: []}
    reads: dict[str, list[float]] = {AIO: [], TORCH: []}
    ok = True

    def aio_write() -> None:
        handle.sync_pwrite(data, aio_path)
        fsync_path(aio_path)

    def torch_write() -> None:
        torch.save(data, pt_path)
        fsync_path(pt_path)

    def aio_read() -> None:
        handle.sync_pread(back, aio_path)

    def torch_read() -> None:
        nonlocal loaded
        loaded = torch.load(pt_path)

    loaded = None
    steps = {AIO: (aio_write, aio_read, aio_path), TORCH: (torch_write, torch_read, pt_path)}
    try:
        for i in range(repeats):
            order = [AIO, TORCH] if i % 2 == 0 else [TORCH, AIO]
            for name in order:
                writes[name].append(gb / demo.timed(steps[name][0]))
            for name in order:
                write, read, path = steps[name]
                demo.make_cold(path)
                back.zero_()
                reads[name].append(gb / demo.timed(read))
                ok &= torch.equal(back if name == AIO else loaded, data)
                loaded = None
    finally:
        for path in (aio_path, pt_path):
            if os.path.exists(path):
                os.unlink(path)
        if kind == "locked":
            handle.free_cpu_locked_tensor(data)

    print()
    print(f"{'GB/s, median (min-max)':<26}{'write':>20}{'read':>20}")
    for name in (AIO, TORCH):
        print(f"{name:<26}{_summary(writes[name]):>20}{_summary(reads[name]):>20}")
    speedup_w = [a / t for a, t in zip(writes[AIO], writes[TORCH])]
    speedup_r = [a / t for a, t in zip(reads[AIO], reads[TORCH])]
    print(f"{'speed-up':<26}{statistics.median(speedup_w):>19.1f}x{statistics.median(speedup_r):>19.1f}x")
    print(f"{'  range over the repeats':<26}{f'{min(speedup_w):.1f}-{max(speedup_w):.1f}x':>20}"
          f"{f'{min(speedup_r):.1f}-{max(speedup_r):.1f}x':>20}")
    print("(GB = 10^9 bytes; writes include fsync; files removed)")
    print("data verified: identical" if ok else "DATA MISMATCH")
    doubts = _doubts(demo, mode, directory, reads, writes, memory_rate)
    if doubts:
        print("these figures may not be the drive's:")
        for doubt in doubts:
            print(f"warning: {doubt}")
    else:
        print("trust: a physical disk, page cache dropped before each read, CPUs otherwise idle")
    return 0 if ok else 1


def main(argv: list[str] | None = None, prog: str = "deepnvme demo") -> int:
    """Parse --size/--dir/--repeats/--rest and run the demo; the first line says whose demo it is."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="tensor size, K/M/G suffixes (default 1G)")
    parser.add_argument("--dir", default=".", help="directory on the drive to test (default: current)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each contender, interleaved; shows median and range (default 3)")
    parser.add_argument("--rest", type=float, default=0.5,
                        help="seconds of rest before each timed step (default 0.5)")
    args = parser.parse_args(argv)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        parser.error(f"argument --size: {exc}")
    if size <= 0:
        parser.error("argument --size: must be positive")
    if args.repeats < 1:
        parser.error("argument --repeats: must be at least 1")
    if not 0 <= args.rest <= 60:
        parser.error("argument --rest: must be between 0 and 60 seconds")
    if not os.path.isdir(args.dir) or not os.access(args.dir, os.W_OK):
        parser.error(f"argument --dir: {args.dir!r} is not a writable directory")
    print(banner(prog, None))
    return run(size, os.path.abspath(args.dir), args.repeats, args.rest)


if __name__ == "__main__":
    sys.exit(main())
