"""GPU <-> file throughput: gds_handle (pinned and unpinned device tensors) beside aio_handle with CUDA
tensors (staged through host memory), aio_handle into a locked host buffer plus a copy, and
torch.save/torch.load. Prints one compact table; --json writes the numbers. Reads drop the file from the
page cache first."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any], reps: int, before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(reps):
        if before:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from op_builder import AsyncIOBuilder, GDSBuilder

    gds, aio = GDSBuilder().load(), AsyncIOBuilder().load()
    args.dir.mkdir(parents=True, exist_ok=True)
    n = args.mib << 20
    f = args.dir / "bench.bin"
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows: list[dict[str, Any]] = []

    def record(name: str, write_s: float, read_s: float) -> None:
        ok = torch.equal(src, dst)
        rows.append({"method": name, "write_GBps": n / write_s / 1e9, "read_GBps": n / read_s / 1e9,
                     "ok": ok})
        dst.zero_()
        print(f"{name:<34} write {n / write_s / 1e9:7.2f} GB/s   read {n / read_s / 1e9:7.2f} GB/s"
              f"   {'ok' if ok else 'MISMATCH'}", flush=True)

    def sync_file() -> None:
        _drop_cache(f)

    for p in args.parallel:
        h = gds.gds_handle(1 << 20, 128, False, False, p)
        if p == args.parallel[0]:
            print(f"cuFile mode: {h.get_io_mode()}  info: {h.get_io_info()}", flush=True)
        for pinned in (True, False):
            if pinned:
                h.pin_device_tensor(src)
                h.pin_device_tensor(dst)
            w = _timed(lambda h=h: (h.sync_pwrite(src, str(f)), os.sync()), args.reps)
            r = _timed(lambda h=h: h.sync_pread(dst, str(f)), args.reps, sync_file)
            record(f"gds_handle P={p} {'pinned' if pinned else 'unpinned'}", w, r)
            if pinned:
                h.unpin_device_tensor(src)
                h.unpin_device_tensor(dst)
        del h

    for p in args.parallel:
        a = aio.aio_handle(1 << 20, 128, False, False, p)
        w = _timed(lambda a=a: (a.sync_pwrite(src, str(f)), os.sync()), args.reps)
        r = _timed(lambda a=a: a.sync_pread(dst, str(f)), args.reps, sync_file)
        record(f"aio_handle P={p} cuda tensor (staged)", w, r)
        host = a.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
        w = _timed(lambda a=a, host=host: (host.copy_(src), a.sync_pwrite(host, str(f)), os.sync()),
                   args.reps)
        r = _timed(lambda a=a, host=host: (a.sync_pread(host, str(f)), dst.copy_(host)), args.reps,
                   sync_file)
        record(f"aio_handle P={p} locked host + copy", w, r)
        a.free_cpu_locked_tensor(host)
        del host, a

    pt = args.dir / "bench.pt"

    def save() -> None:
        with pt.open("wb") as fh:
            torch.save(src, fh)
            fh.flush()
            os.fsync(fh.fileno())

    def load() -> None:
        dst.copy_(torch.load(pt, map_location="cuda"))

    w = _timed(save, args.reps)
    r = _timed(load, args.reps, lambda: _drop_cache(pt))
    record("torch.save / torch.load", w, r)
    f.unlink(missing_ok=True)
    pt.unlink(missing_ok=True)
    if args.json:
        args.json.write_text(json.dumps({"bytes": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
