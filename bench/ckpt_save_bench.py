#!/usr/bin/env python3
"""deepnvme.save / deepnvme.load beside torch.save+fsync / torch.load and the raw handle, on one state dict.

    python3 bench/ckpt_save_bench.py [--dir /work/benchtmp] [--size 1.2G] [--tensors 96] [--repeats 3]

One run, contenders interleaved in every repeat, 1 s of rest before each case (the VM's disk has a burst
allowance). Loads start from a cold cache (the file's pages are flushed and evicted first). GB = 10^9 bytes.
"Raw handle" writes / reads the same payload bytes, one async request per tensor at page-aligned offsets
of one new file and one wait(): the ceiling for a checkpoint format on this handle. "Peak extra RSS" is the
process's peak resident memory during the save beyond its size before it (the kernel's high-water mark,
reset first: bench/_harness.py), so the state dict itself is not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _harness import PeakMemory, wall  # puts this checkout on sys.path before deepnvme is imported

import deepnvme
from deepnvme._core.handles import default_handle
from deepnvme._core.memory import PAGE
from deepnvme.tools.pagecache import drop_file_cache, fsync_path
from deepnvme.tools.sizes import parse_size


def state_dict(total: int, count: int) -> dict[str, torch.Tensor]:
    per = total // count // 4
    return {f"layer{i}.weight": torch.randn(per) for i in range(count)}


def raw_offsets(sd: dict[str, torch.Tensor]) -> list[int]:
    offsets, at = [], 0
    for t in sd.values():
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // PAGE) * PAGE
    return offsets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".", help="directory on the drive to measure (default: .)")
    p.add_argument("--size", default="1154M", help="state dict bytes (default 1154M = 1.21 GB)")
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rest", type=float, default=1.0)
    args = p.parse_args(argv)

    sd = state_dict(parse_size(args.size), args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    handle = default_handle()
    paths = {k: os.path.join(args.dir, f"ckpt_bench_{k}.pt") for k in ("torch", "deepnvme", "nocrc", "raw")}
    offsets = raw_offsets(sd)
    dests = {k: torch.empty_like(t) for k, t in sd.items()}

    def torch_save() -> None:
        torch.save(sd, paths["torch"])
        fsync_path(paths["torch"])

    def dn_save() -> None:
        deepnvme.save(sd, paths["deepnvme"])

    def dn_save_nocrc() -> None:
        deepnvme.save(sd, paths["nocrc"], checksum=False)

    def raw_write() -> None:
        # A new file, as the others write (an atomic save replaces the file, torch.save truncates it):
        # overwriting blocks already allocated would be cheaper than any of them can be.
        if os.path.exists(paths["raw"]):
            os.unlink(paths["raw"])
        fd = os.open(paths["raw"], os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
        try:
            for t, off in zip(sd.values(), offsets):
                handle.async_pwrite(t.view(-1).view(torch.uint8), fd, off)
            handle.wait()
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_load() -> None:
        torch.load(paths["torch"], weights_only=True)

    def dn_load() -> None:
        deepnvme.load(paths["deepnvme"])

    def dn_load_noverify() -> None:
        deepnvme.load(paths["deepnvme"], verify=False)

    def dn_load_stock() -> None:
        deepnvme.load(paths["torch"])

    def raw_read(fresh: bool) -> None:
        fd = os.open(paths["raw"], os.O_RDONLY | os.O_DIRECT)
        try:
            for t, off in zip(dests.values(), offsets):
                t = torch.empty_like(t) if fresh else t  # fresh: its pages are faulted in by the read
                handle.async_pread(t.view(-1).view(torch.uint8), fd, off)
            handle.wait()
        finally:
            os.close(fd)

    saves: list[tuple[str, Callable[[], None]]] = [
        ("torch.save + fsync", torch_save), ("deepnvme.save", dn_save),
        ("deepnvme.save checksum=False", dn_save_nocrc), ("raw handle write", raw_write)]
    loads: list[tuple[str, Callable[[], None], str]] = [
        ("torch.load (cold)", torch_load, "torch"), ("deepnvme.load (cold)", dn_load, "deepnvme"),
        ("deepnvme.load verify=False (cold)", dn_load_noverify, "deepnvme"),
        ("deepnvme.load of a torch.save file (cold)", dn_load_stock, "torch"),
        ("raw handle read into reused tensors (cold)", lambda: raw_read(False), "raw"),
        ("raw handle read into new tensors (cold)", lambda: raw_read(True), "raw")]
    times: dict[str, list[float]] = {}
    extra: dict[str, list[int]] = {}
    with PeakMemory() as first:
        dn_save()  # warm up: the op is loaded, the handle made, its process-wide staging pool allocated
    for r in range(args.repeats):
        for name, fn in saves:
            time.sleep(args.rest)
            with PeakMemory() as peak:
                times.setdefault(name, []).append(wall(fn))
            extra.setdefault(name, []).append(peak.extra)
        for name, fn, key in loads:
            drop_file_cache(paths[key])
            time.sleep(args.rest)
            times.setdefault(name, []).append(wall(fn))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    for path in paths.values():
        os.unlink(path)

    def gbs(name: str) -> float:
        return nbytes / statistics.median(times[name]) / 1e9

    print(f"{args.tensors} float32 tensors, {nbytes / 1e9:.2f} GB, {args.repeats} interleaved repeats, "
          f"engine {handle.get_engine()}, median (min-max) GB/s\n")
    print("| what | GB/s | peak extra RSS during save |")
    print("| --- | --- | --- |")
    for name in [n for n, _ in saves] + [n for n, _, _ in loads]:
        rates = sorted(nbytes / t / 1e9 for t in times[name])
        rss = f"{max(extra[name]) / 2**20:.1f} MiB" if name in extra else ""
        print(f"| {name} | {gbs(name):.2f} ({rates[0]:.2f}-{rates[-1]:.2f}) | {rss} |")
    print()
    print(f"- first deepnvme.save of the process (op load, handle, its staging pool): peak extra RSS "
          f"{first.extra / 2**20:.1f} MiB")
    for name in ("deepnvme.save", "deepnvme.save checksum=False"):
        print(f"- {name} / torch.save+fsync: {gbs(name) / gbs('torch.save + fsync'):.2f}x; "
              f"/ raw handle write: {gbs(name) / gbs('raw handle write'):.2f}x")
    reused = gbs("raw handle read into reused tensors (cold)")
    new = gbs("raw handle read into new tensors (cold)")
    for name in ("deepnvme.load (cold)", "deepnvme.load verify=False (cold)"):
        print(f"- {name} / torch.load: {gbs(name) / gbs('torch.load (cold)'):.2f}x; / raw handle read "
              f"into reused / new tensors: {gbs(name) / reused:.2f}x / {gbs(name) / new:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
