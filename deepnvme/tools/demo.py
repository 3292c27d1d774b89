"""The main job in one command: a tensor written and read through aio_handle, beside torch.save/torch.load.

    deepnvme demo --size 1G [--dir DIR]        (also python3 -m deepnvme demo ...)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from deepnvme.files import fsync_path
from deepnvme.tools.ownership import banner
from deepnvme.tools.pagecache import DESCRIPTIONS, drop_file_cache, read_mode
from deepnvme.tools.pattern import fill_pattern
from deepnvme.tools.sizes import parse_size

# The simple settings that reach the drive here: 1 MiB blocks, 32 in flight, overlapped events, 2 threads.
SETTINGS = {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True,
            "intra_op_parallelism": 2}


def _human(n: int) -> str:
    """A size for people: 1 GiB, 4 MiB, 1000001 bytes."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.4g} {name}"
    return f"{n} bytes"


def run(size: int, directory: str) -> int:
    """Write and read `size` bytes with deepnvme and with torch; print GB/s; 0 when the data round-trips."""
    import torch

    from deepnvme import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    handle = aio.aio_handle(**SETTINGS)
    mode = read_mode(directory)
    gb = size / 1e9
    print(f"engine: {handle.get_engine()} (available: {', '.join(aio.available_engines())})")
    print(f"settings: block 1 MiB, queue depth 32, overlap_events, 2 threads; {_human(size)} "
          f"in {directory}")
    print(f"reads: {DESCRIPTIONS[mode]}")

    try:
        data = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        kind = "locked"
    except (MemoryError, OSError, RuntimeError) as exc:
        data = torch.empty(size, dtype=torch.uint8)  # plain tensors run at full speed too
        kind = f"plain (locking failed: {exc})"
    print(f"tensor: {kind}")
    fill_pattern(data)
    back = torch.empty(size, dtype=torch.uint8)

    fd, aio_path = tempfile.mkstemp(prefix="deepnvme_demo_", suffix=".bin", dir=directory)
    os.close(fd)
    pt_path = aio_path[:-4] + ".pt"
    rows = []
    ok = True
    try:
        start = time.perf_counter()
        handle.sync_pwrite(data, aio_path)
        fsync_path(aio_path)
        aio_w = time.perf_counter() - start
        drop_file_cache(aio_path)
        start = time.perf_counter()
        handle.sync_pread(back, aio_path)
        aio_r = time.perf_counter() - start
        ok &= torch.equal(back, data)
        rows.append(("deepnvme aio_handle", aio_w, aio_r))

        start = time.perf_counter()
        torch.save(data, pt_path)
        fsync_path(pt_path)
        pt_w = time.perf_counter() - start
        drop_file_cache(pt_path)
        start = time.perf_counter()
        loaded = torch.load(pt_path)
        pt_r = time.perf_counter() - start
        ok &= torch.equal(loaded, data)
        del loaded
        rows.append(("torch.save / torch.load", pt_w, pt_r))
    finally:
        for path in (aio_path, pt_path):
            if os.path.exists(path):
                os.unlink(path)
        if kind == "locked":
            handle.free_cpu_locked_tensor(data)

    print()
    print(f"{'':<26}{'write GB/s':>11}{'read GB/s':>11}")
    for name, w, r in rows:
        print(f"{name:<26}{gb / w:>11.2f}{gb / r:>11.2f}")
    print(f"{'speed-up':<26}{pt_w / aio_w:>10.1f}x{pt_r / aio_r:>10.1f}x")
    print("(GB = 10^9 bytes; writes include fsync; files removed)")
    print("data verified: identical" if ok else "DATA MISMATCH")
    return 0 if ok else 1


def main(argv: list[str] | None = None, prog: str = "deepnvme demo") -> int:
    """Parse --size/--dir and run the demo; the first line says whose demo it is."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="tensor size, K/M/G suffixes (default 1G)")
    parser.add_argument("--dir", default=".", help="directory on the drive to test (default: current)")
    args = parser.parse_args(argv)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        parser.error(f"argument --size: {exc}")
    if not os.path.isdir(args.dir) or not os.access(args.dir, os.W_OK):
        parser.error(f"argument --dir: {args.dir!r} is not a writable directory")
    print(banner(prog, None))
    return run(size, os.path.abspath(args.dir))


if __name__ == "__main__":
    sys.exit(main())
