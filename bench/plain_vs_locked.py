"""Plain (unlocked) against locked tensors through aio_handle, with or without another handle staging first.

The aio bench has measured plain tensors well behind locked ones, while a process with a single handle keeps
them close. This script reproduces both in one run so the cause can be chased: `--other-stager` makes a
throw-away handle read into an unaligned tensor (allocating its staging pool) before the measured handles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deepnvme.tools.pagecache import drop_file_cache  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Print median GB/s of locked and plain 1 GiB writes/reads and their ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/work/benchtmp", help="directory on the disk under test")
    p.add_argument("--engine", default="io_uring")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--other-stager", action="store_true", help="let another handle stage first")
    args = p.parse_args(argv)

    import torch

    from deepnvme import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    size = 1 << 30
    kw = {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True,
          "intra_op_parallelism": 2, "engine": args.engine}
    os.makedirs(args.dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="plain_vs_locked_", dir=args.dir)
    os.close(fd)
    try:
        owner = aio.aio_handle()
        locked = owner.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        locked.fill_(3)
        plain = torch.empty(size, dtype=torch.uint8)
        plain.copy_(locked)
        h_locked, h_plain = aio.aio_handle(**kw), aio.aio_handle(**kw)
        h_locked.sync_pwrite(locked, path)
        if args.other_stager:
            aio.aio_handle(**kw).sync_pread(torch.empty(64 << 20, dtype=torch.uint8)[1:], path)
        runs: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for kind, h, t in (("locked", h_locked, locked), ("plain", h_plain, plain)):
                for op in ("write", "read"):
                    if op == "read":
                        drop_file_cache(path)
                    start = time.perf_counter()
                    (h.sync_pwrite if op == "write" else h.sync_pread)(t, path)
                    runs.setdefault((kind, op), []).append(size / (time.perf_counter() - start) / 1e9)
        for op in ("write", "read"):
            lk, pl = statistics.median(runs[("locked", op)]), statistics.median(runs[("plain", op)])
            print(f"{op}: locked {lk:.2f} GB/s, plain {pl:.2f} GB/s, plain/locked {pl / lk:.2f}x "
                  f"(other stager: {args.other_stager})")
        owner.free_cpu_locked_tensor(locked)
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
