#!/usr/bin/env python3
"""What the memory on either side of a checkpoint transfer costs: A/Bs of where a load reads into and where
a save writes from, with the same handle, file and bytes.

    python3 bench/ckpt_memory_ab.py [--dir DIR] [--size 1.2G] [--tensors 96] [--repeats 5] [--quick]

The file is `--tensors` equal tensors back to back at page-aligned offsets, one async request per tensor on
the checkpoint handle (deepnvme._core.handles.checkpoint_handle), as deepnvme.load and deepnvme.save issue
them. Every sample runs in a process of its own (so no variant inherits pages another one made: the
kernel's cost of first-touching memory is what is measured), the variants in an order rotated every repeat.
Loads read with O_DIRECT after the file's cached pages were evicted; saves write a new file and fsync it.

Load destinations:
  fresh        a new page-aligned storage per tensor, as deepnvme.load makes them (empty_at_residue);
  populate     the same, with a thread faulting their pages in ahead of the reads (MADV_POPULATE_WRITE,
               Linux 5.14+; deepnvme._core.memory.Populator), so the page-fault work runs beside the I/O;
  huge         the same, each storage advised for transparent huge pages (MADV_HUGEPAGE);
  one_storage  one new storage for all tensors (fewer, larger mappings), the tensors views of it;
  ring         a reused ring of 4 locked tensor-sized buffers on two handles, each copied out into a new
               storage while the next reads run;
  ahead        fresh storages, each faulted in by a thread running ahead of the reads (MADV_POPULATE_WRITE,
               its chunks split over two threads) and read only once faulted, so faulting and reading
               overlap as a pipeline instead of the reads faulting their own pages;
  ahead_fill   the same, faulted by writing zeros with torch's fill_ (its intra-op threads);
  huge_ahead   "ahead" with each storage advised for transparent huge pages first;
  bounced      fresh storages 64 bytes past a page (as torch's allocator places them), so the handle reads
               through its locked staging buffers and its worker threads copy into them: the copies fault
               the new pages in user space, on every worker at once, beside the reads;
  bounced_populate  "bounced" with the populate thread ahead of the copies: what deepnvme.load does;
  locked       one locked buffer whose pages exist before the clock starts: the bound's destination.
Save sources:
  staged       tensors as torch allocates them (64 bytes past a page: the handle stages their bytes);
  congruent    the same tensors at file offsets congruent to their memory modulo the page: each tensor's
               body goes O_DIRECT from its own memory, its partial first and last pages from a staging
               page (the layout a zip writer choosing each record's padding could give);
  aligned      page-aligned locked memory, straight to the device.
GB = 10^9 bytes; cells are median GB/s (min-max) and median CPU-seconds of the process per GB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from _harness import timed  # first: puts this checkout on sys.path

from deepnvme._core.direct import close_pair, open_for_write
from deepnvme._core.handles import checkpoint_handle
from deepnvme._core.memory import MADV_POPULATE_WRITE, PAGE, Populator
from deepnvme._core.memory import madvise as madvise_range
from deepnvme._core.op import aio_module
from deepnvme.tools.pagecache import drop_file_cache
from deepnvme.tools.resident import touch_pages
from deepnvme.tools.sizes import parse_size

LOADS = ["fresh", "populate", "huge", "one_storage", "ring", "ahead", "ahead_fill", "huge_ahead", "bounced",
         "bounced_populate", "locked"]
SAVES = ["staged", "congruent", "aligned"]
MADV_HUGEPAGE = 14
RING_SLOTS = 4


def madvise(t: torch.Tensor, advice: int, start: int = 0, length: int | None = None) -> None:
    """madvise over bytes [start, start + length) of `t` (page-aligned memory); OSError when refused."""
    n = t.numel() - start if length is None else length
    err = madvise_range(t.data_ptr() + start, n, advice)
    if err:
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


def fault_ahead(tensors: list[torch.Tensor], ready: list[threading.Event], how: str,
                failed: list[OSError]) -> None:
    """Fault in each tensor's pages in order, setting its event once done: the reads follow behind."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(2) as pool:
            for t, event in zip(tensors, ready):
                if how == "fill":
                    t.fill_(0)
                else:
                    half = t.numel() // 2 // PAGE * PAGE
                    parts = [(0, half), (half, t.numel() - half)]
                    list(pool.map(lambda p, t=t: madvise(t, MADV_POPULATE_WRITE, *p), parts))
                event.set()
    except OSError as exc:
        failed.append(exc)
    finally:
        for event in ready:  # a failure must not leave the reader waiting
            event.set()


def load(variant: str, path: str, count: int, per: int) -> tuple[float, float]:
    """Read the file into the variant's destination; wall and CPU seconds."""
    h = checkpoint_handle(os.path.dirname(path))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    locked = None
    if variant in ("locked", "ring"):
        slots = count if variant == "locked" else RING_SLOTS
        locked = h.new_cpu_locked_tensor(slots * per, torch.empty(0, dtype=torch.uint8))
        touch_pages(locked)
    drop_file_cache(path)
    failed: list[OSError] = []

    def run() -> None:
        new = aio_module().empty_at_residue
        if variant == "ring":
            return ring(h, checkpoint_handle(os.path.dirname(path), slot=1), fd, locked, count, per)
        if variant == "locked":
            tensors = [locked[i * per:(i + 1) * per] for i in range(count)]
        elif variant == "one_storage":
            whole = new(count * per, 0)
            tensors = [whole[i * per:(i + 1) * per] for i in range(count)]
        else:
            tensors = [new(per, 64 if variant.startswith("bounced") else 0) for _ in range(count)]
        if variant in ("huge", "huge_ahead"):
            for t in tensors:
                madvise(t, MADV_HUGEPAGE)
        ready = [threading.Event() for _ in tensors]
        helper = None
        populator = Populator(tensors).start() if variant in ("populate", "bounced_populate") else None
        if variant.endswith("ahead") or variant == "ahead_fill":
            how = "fill" if variant == "ahead_fill" else "populate"
            helper = threading.Thread(target=fault_ahead, args=(tensors, ready, how, failed))
        if helper:
            helper.start()
        try:
            for i, t in enumerate(tensors):
                if helper:
                    ready[i].wait()
                h.async_pread(t, fd, i * per)
            h.wait()
            if helper:
                helper.join()
        finally:
            if populator:
                populator.close()

    try:
        got = timed(run)
    finally:
        os.close(fd)
        if locked is not None:
            h.free_cpu_locked_tensor(locked)
    if failed:
        raise failed[0]
    return got


def ring(h: Any, h2: Any, fd: int, slots: torch.Tensor, count: int, per: int) -> None:
    """Reads into a reused ring of locked slots on two handles, each copied out into a new storage while
    the next reads run."""
    new = aio_module().empty_at_residue
    handles = [h, h2]
    ahead = min(RING_SLOTS // 2, count)
    slot = [slots[i * per:(i + 1) * per] for i in range(RING_SLOTS)]
    for i in range(ahead):
        handles[i % 2].async_pread(slot[i], fd, i * per)
    out = []
    for i in range(count):
        handles[i % 2].wait()
        if i + ahead < count:
            handles[(i + ahead) % 2].async_pread(slot[(i + ahead) % RING_SLOTS], fd, (i + ahead) * per)
        out.append(new(per, 0).copy_(slot[i % RING_SLOTS]))


def save(variant: str, path: str, count: int, per: int) -> tuple[float, float]:
    """Write the variant's source tensors to a new file and fsync it; wall and CPU seconds."""
    h = checkpoint_handle(os.path.dirname(path))
    locked = None
    if variant == "aligned":
        locked = h.new_cpu_locked_tensor(count * per, torch.empty(0, dtype=torch.uint8))
        tensors = [locked[i * per:(i + 1) * per] for i in range(count)]
    else:
        tensors = [torch.empty(per, dtype=torch.uint8) for _ in range(count)]
    for t in tensors:
        t.fill_(7)
    edge_pages = aio_module().empty_at_residue(2 * count * PAGE, 0)  # the staging pages of "congruent"
    touch_pages(edge_pages)
    if os.path.exists(path):
        os.unlink(path)

    def run() -> None:
        direct, buffered = open_for_write(path, os.O_CREAT | os.O_EXCL, 0o644)
        try:
            at = 0
            for i, t in enumerate(tensors):
                if variant != "congruent":
                    h.async_pwrite(t, direct, at)
                    at += -(-per // PAGE) * PAGE
                    continue
                start = at + t.data_ptr() % PAGE  # the tensor's first byte, congruent to its memory
                head = -start % PAGE
                body = (per - head) // PAGE * PAGE
                tail = per - head - body
                first = edge_pages[2 * i * PAGE:(2 * i + 1) * PAGE]
                last = edge_pages[(2 * i + 1) * PAGE:(2 * i + 2) * PAGE]
                first[PAGE - head:].copy_(t[:head])
                last[:tail].copy_(t[head + body:])
                h.async_pwrite(first, direct, start + head - PAGE)
                h.async_pwrite(t[head:head + body], direct, start + head)
                h.async_pwrite(last, direct, start + head + body)
                at = start + head + body + PAGE
            h.wait()
            os.fsync(buffered)
        finally:
            close_pair(direct, buffered)

    try:
        return timed(run)
    finally:
        os.unlink(path)
        if locked is not None:
            h.free_cpu_locked_tensor(locked)


def one(variant: str, path: str, count: int, per: int) -> None:
    """Child process: one sample, printed as JSON."""
    wall, cpu = (load if variant in LOADS else save)(variant, path + (".w" if variant in SAVES else ""),
                                                     count, per)
    print(json.dumps({"wall": wall, "cpu": cpu}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp", help="where the test files are written (a real disk)")
    ap.add_argument("--size", default="1.2G", help="bytes of tensors in all")
    ap.add_argument("--tensors", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="0.5 GB, 3 repeats")
    ap.add_argument("--variants", help="comma-separated variants to run (default: all)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.size, args.repeats = "512M", 3
    per = parse_size(args.size) // args.tensors // PAGE * PAGE
    path = str(Path(args.dir) / "ckpt_memory_ab.bin")
    if args.one:
        return one(args.one, path, args.tensors, per)
    chunk = os.urandom(per)
    with open(path, "wb") as f:
        for _ in range(args.tensors):
            f.write(chunk)
        os.fsync(f.fileno())
    variants = LOADS + SAVES
    if args.variants:
        variants = [v for v in args.variants.split(",") if v]
        unknown = set(variants) - set(LOADS + SAVES)
        if unknown:
            ap.error(f"unknown variants {sorted(unknown)} (known: {', '.join(LOADS + SAVES)})")
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    failed: dict[str, str] = {}
    try:
        for r in range(args.repeats):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                argv = [sys.executable, __file__, "--one", v, "--dir", args.dir, "--size", args.size,
                        "--tensors", str(args.tensors)]
                out = subprocess.run(argv, capture_output=True, text=True)
                if out.returncode:  # e.g. a kernel without MADV_POPULATE_WRITE: say so, measure the rest
                    failed[v] = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
                    continue
                samples[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        os.unlink(path)
    gb = per * args.tensors / 1e9
    print(f"{args.tensors} tensors of {per} bytes ({gb:.2f} GB), {args.repeats} repeats, load average "
          f"{os.getloadavg()[0]:.1f}\n\n| variant | GB/s median (min-max) | CPU-s/GB |\n| --- | --- | --- |")
    for v in variants:
        if not samples[v]:
            print(f"| {'load' if v in LOADS else 'save'} {v} | failed: {failed.get(v, '?')} | |")
            continue
        rates = sorted(gb / s["wall"] for s in samples[v])
        cpu = statistics.median(s["cpu"] for s in samples[v]) / gb
        print(f"| {'load' if v in LOADS else 'save'} {v} | {statistics.median(rates):.2f} "
              f"({rates[0]:.2f}-{rates[-1]:.2f}) | {cpu:.2f} |")


if __name__ == "__main__":
    main()
