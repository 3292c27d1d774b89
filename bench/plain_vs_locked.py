"""Plain (unlocked) against locked tensors through aio_handle, over a grid of block sizes and queue depths.

A plain ``torch.empty`` tensor cannot go O_DIRECT as it is (its address is not aligned the way the file
offset is), so its bytes are staged through the process-wide staging pool; a locked tensor from
``new_cpu_locked_tensor`` is page-aligned and goes straight to the device. This script measures both at the
same settings, interleaved, and prints plain/locked per block size, queue depth and direction, with the CPU
seconds each spent per GiB (process CPU time: every thread of the process, kernel time included).

``--other-stager`` first lets a throw-away handle stage a read (allocating the staging pool) before the
measured handles, for the case where another handle of the process staged first.

Quick (the lead's final run, about 1 minute): ``python3 bench/plain_vs_locked.py --quick``
Full grid (128 KiB..16 MiB x QD 8..128, about 4 minutes): ``python3 bench/plain_vs_locked.py``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _harness import timed  # first: puts this checkout on sys.path

from deepnvme.tools.pagecache import drop_file_cache
from deepnvme.tools.resident import touch_pages
from deepnvme.tools.sizes import parse_size

FULL_BLOCKS = "128K,256K,1M,4M,8M,16M"
FULL_DEPTHS = "8,32,128"
QUICK_BLOCKS = "128K,1M,8M,16M"
QUICK_DEPTHS = "8,128"


def main(argv: list[str] | None = None) -> int:
    """Measure the grid and print one line per cell; optionally save the medians as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/work/benchtmp", help="directory on the disk under test")
    p.add_argument("--engine", default="io_uring")
    p.add_argument("--size", default="1G", help="bytes per transfer (K/M/G suffixes)")
    p.add_argument("--blocks", default=FULL_BLOCKS, help="comma-separated block sizes")
    p.add_argument("--depths", default=FULL_DEPTHS, help="comma-separated queue depths")
    p.add_argument("--threads", type=int, default=2, help="intra_op_parallelism")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help=f"blocks {QUICK_BLOCKS}, depths {QUICK_DEPTHS}, 512 MiB transfers")
    p.add_argument("--other-stager", action="store_true", help="let another handle stage first")
    p.add_argument("--json", help="write the medians here")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks, args.depths, args.size = QUICK_BLOCKS, QUICK_DEPTHS, "512M"

    import torch

    from deepnvme import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    size = parse_size(args.size)
    blocks = [parse_size(b) for b in args.blocks.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="plain_vs_locked_", dir=args.dir)
    os.close(fd)
    results = []
    try:
        owner = aio.aio_handle()
        locked = owner.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        locked.fill_(3)
        plain = torch.empty(size, dtype=torch.uint8)
        plain.copy_(locked)
        print(f"plain tensor address % 4096 = {plain.data_ptr() % 4096}, locked % 4096 = "
              f"{locked.data_ptr() % 4096}; {size >> 20} MiB per transfer, engine {args.engine}, "
              f"{args.threads} threads, medians of {args.repeats}")
        owner.sync_pwrite(locked, path)
        if args.other_stager:
            aio.aio_handle(engine=args.engine).sync_pread(torch.empty(64 << 20, dtype=torch.uint8)[1:], path)
        print(f"{'block':>6} {'QD':>4} {'op':>5}  {'locked GB/s':>11} {'plain GB/s':>10} {'plain/locked':>12}"
              f"  {'CPU-s/GiB locked':>16} {'plain':>6}")
        for block in blocks:
            for depth in depths:
                kw = {"block_size": block, "queue_depth": depth, "single_submit": False,
                      "overlap_events": True, "intra_op_parallelism": args.threads, "engine": args.engine}
                handles = {"locked": aio.aio_handle(**kw), "plain": aio.aio_handle(**kw)}
                tensors = {"locked": locked, "plain": plain}
                # Untimed: the staging pool's first allocation and each worker ring's registration of it
                # happen on a handle's first staged transfer, once per process and handle, not per transfer.
                warm = plain[:min(size, 8 * block * args.threads)]
                handles["plain"].sync_pwrite(warm, path)
                handles["plain"].sync_pread(warm, path)
                runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
                for i in range(args.repeats):
                    # Alternate which kind goes first, so neither always inherits the other's cache state.
                    kinds = ("locked", "plain") if i % 2 == 0 else ("plain", "locked")
                    for op in ("write", "read"):
                        for kind in kinds:
                            h, t = handles[kind], tensors[kind]
                            if op == "read":
                                drop_file_cache(path)
                            touch_pages(t)  # resident before the clock (see deepnvme.tools.resident)
                            fn = h.sync_pwrite if op == "write" else h.sync_pread
                            runs.setdefault((kind, op), []).append(timed(lambda fn=fn, t=t: fn(t, path)))
                for op in ("write", "read"):
                    cell = {"block": block, "depth": depth, "op": op}
                    for kind in ("locked", "plain"):
                        wall = statistics.median(w for w, _ in runs[(kind, op)])
                        cpu = statistics.median(c for _, c in runs[(kind, op)])
                        cell[kind] = {"gbps": size / wall / 1e9, "cpu_s_per_gib": cpu / (size / (1 << 30))}
                    ratio = cell["plain"]["gbps"] / cell["locked"]["gbps"]
                    cell["ratio"] = ratio
                    results.append(cell)
                    print(f"{block >> 10:>5}K {depth:>4} {op:>5}  {cell['locked']['gbps']:>11.2f} "
                          f"{cell['plain']['gbps']:>10.2f} {ratio:>11.2f}x  "
                          f"{cell['locked']['cpu_s_per_gib']:>16.3f} {cell['plain']['cpu_s_per_gib']:>6.3f}",
                          flush=True)
                del handles
        owner.free_cpu_locked_tensor(locked)
    finally:
        os.unlink(path)
    worst = min(results, key=lambda c: c["ratio"])
    print(f"worst plain/locked {worst['ratio']:.2f}x ({worst['op']}, block {worst['block'] >> 10}K, "
          f"QD {worst['depth']}); plain CPU-s/GiB max "
          f"{max(c['plain']['cpu_s_per_gib'] for c in results):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
