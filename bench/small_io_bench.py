"""Small synchronous reads: aio_handle.sync_pread against a raw O_DIRECT os.preadv, side by side.

Measures what one small request costs end to end at queue depth 1 (random aligned offsets in one file,
page cache bypassed), two ways, each interleaved with its raw counterpart call by call:

- by path: ``open(O_DIRECT) + preadv + close`` against ``handle.sync_pread(t, path, off)``;
- by fd: ``preadv`` on an open O_DIRECT descriptor against ``handle.sync_pread(t, fd, off)``.

Both sides read into page-aligned memory (a locked tensor, whose buffer the raw side also uses) so that the
figure is the handle's own cost, not a staging copy. Prints median microseconds and handle/raw ratios.
One command: ``python3 bench/small_io_bench.py`` (about 10 s at the default 2000 calls per variant).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from functools import partial

from _harness import wall  # first: puts this checkout on sys.path


def median_us(samples: list[float]) -> float:
    """Median of a list of seconds, in microseconds."""
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print one line per variant."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/work/benchtmp", help="directory on the disk under test")
    p.add_argument("--size", type=int, default=4096, help="bytes per read (a multiple of the device block)")
    p.add_argument("--file-mib", type=int, default=256, help="size of the file read from")
    p.add_argument("--calls", type=int, default=2000, help="reads per variant and side")
    p.add_argument("--engine", default="auto")
    p.add_argument("--write", action="store_true", help="measure sync_pwrite against os.pwritev instead")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    import torch

    from deepnvme import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    handle = aio.aio_handle(block_size=1 << 20, queue_depth=8, engine=args.engine)
    os.makedirs(args.dir, exist_ok=True)
    fd0, path = tempfile.mkstemp(prefix="small_io_", dir=args.dir)
    try:
        chunk = os.urandom(1 << 20)
        for _ in range(args.file_mib):
            os.write(fd0, chunk)
        os.fsync(fd0)
        os.close(fd0)
        buf = handle.new_cpu_locked_tensor(args.size, torch.empty(0, dtype=torch.uint8))
        view = memoryview(buf.numpy())
        rng = random.Random(args.seed)
        slots = (args.file_mib << 20) // args.size
        flags = os.O_RDWR if args.write else os.O_RDONLY
        rawop = os.pwritev if args.write else os.preadv
        hop = handle.sync_pwrite if args.write else handle.sync_pread

        def raw_path(off: int) -> None:
            fd = os.open(path, flags | os.O_DIRECT)
            try:
                if rawop(fd, [view], off) != args.size:
                    raise OSError("short transfer")
            finally:
                os.close(fd)

        dfd = os.open(path, flags | os.O_DIRECT)
        try:
            variants = {
                "by path": (raw_path, lambda off: hop(buf, path, off)),
                "by fd": (lambda off: rawop(dfd, [view], off), lambda off: hop(buf, dfd, off)),
            }
            op = "write" if args.write else "read"
            print(f"{args.size}-byte sync {op}s at QD1, {args.calls} random offsets in a {args.file_mib} MiB "
                  f"file, engine {handle.get_engine()}; median microseconds")
            for name, (raw, mine) in variants.items():
                for _ in range(50):  # warm both sides (first open, first registration, page tables)
                    off = rng.randrange(slots) * args.size
                    raw(off)
                    mine(off)
                t_raw: list[float] = []
                t_mine: list[float] = []
                for i in range(args.calls):
                    off = rng.randrange(slots) * args.size
                    # Alternate which side goes first, so neither always follows the other's cache effects.
                    order = ((raw, t_raw), (mine, t_mine)) if i % 2 == 0 else ((mine, t_mine), (raw, t_raw))
                    for fn, out in order:
                        out.append(wall(partial(fn, off)))
                r, m = median_us(t_raw), median_us(t_mine)
                print(f"{name:8s} raw {r:7.1f} us  handle {m:7.1f} us  handle/raw {m / r:.2f}x")
        finally:
            os.close(dfd)
        handle.free_cpu_locked_tensor(buf)
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
