#!/usr/bin/env python3
"""deepnvme beside fio, torch.save/load and numpy on the same disk, in one run with interleaved repeats.

    python3 bench/aio_bench.py [--dir /work/benchtmp] [--repeats 3] [--size 1G] [--out _bench_out/aio_bench]

Measures (GB = 10^9 bytes; CPU = user+system seconds of the process, or of fio and its jobs, per GiB moved):
  * sequential write and read of one file with several aio_handle settings (engines, queue depths,
    threads, locked and plain tensors) and fio's libaio / io_uring (+ fixed buffers), direct=1, iodepth
    32/128, 1 and 2 jobs; reads bypass the page cache (O_DIRECT) and the file is also evicted beforehand;
  * 1000 reads of 64 KiB queued with async_pread and drained by one wait(), from one file and from 1000
    files, beside fio's 64 KiB randread (direct=1, iodepth 32);
  * torch.save+fsync / torch.load and numpy tofile+fsync / fromfile on a cold cache;
  * DeepSpeed's aio_handle when `import deepspeed` works, in a process of its own (bench/deepspeed_side.py).
Writes a markdown table to stdout and <out>.md, every sample to <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's deepnvme, not an installed one

from deepnvme.files import fsync_path, mount_of  # noqa: E402
from deepnvme.tools.pagecache import DESCRIPTIONS, drop_file_cache, read_mode  # noqa: E402
from deepnvme.tools.sizes import parse_size  # noqa: E402

GIB = 1 << 30
SMALL_COUNT = 1000
SMALL_SIZE = 64 << 10


@dataclass
class Case:
    """One measured thing: a name, a kind of operation, a function returning (seconds, cpu seconds), or None
    when it could not be measured this time."""

    group: str
    name: str
    op: str  # "write" | "read" | "small"
    run: Callable[[], tuple[float, float] | None]
    nbytes: int
    samples: list[dict] = field(default_factory=list)


def cpu_self() -> float:
    """User+system CPU seconds of this process (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_children() -> float:
    """User+system CPU seconds of waited-for children (fio and its job processes)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of fn() in this process."""
    c0, t0 = cpu_self(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_self() - c0


def make_file(path: str, size: int) -> None:
    """Write `size` bytes of non-zero data, so reads of it do real I/O, and push it to the drive."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------- fio
def run_fio(args: list[str]) -> tuple[dict, float]:
    """Run fio with JSON output; (the group-reported job record, CPU seconds of fio and its jobs)."""
    c0 = cpu_children()
    proc = subprocess.run(["fio", "--output-format=json", "--group_reporting", *args],
                          capture_output=True, text=True, check=False)
    cpu = cpu_children() - c0
    if proc.returncode != 0:
        raise RuntimeError(f"fio {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    text = proc.stdout
    return json.loads(text[text.index("{"):])["jobs"][0], cpu


def fio_seq(path: str, size: int, op: str, engine: str, depth: int, jobs: int, fixed: bool
            ) -> Callable[[], tuple[float, float]]:
    """A fio sequential job over the same file as deepnvme; each job takes its own contiguous share."""
    share = size // jobs
    args = [f"--name=seq_{op}", f"--filename={path}", f"--rw={op}", "--bs=1M", "--direct=1",
            f"--ioengine={engine.split('+')[0]}", f"--iodepth={depth}", f"--numjobs={jobs}",
            f"--size={share}", f"--offset_increment={share}"]
    if fixed:
        args.append("--fixedbufs")

    def run() -> tuple[float, float]:
        if op == "read":
            drop_file_cache(path)
        job, cpu = run_fio(args)
        # fio's own bandwidth excludes its start-up; convert to the seconds it spent moving `size` bytes.
        return size / job[op]["bw_bytes"], cpu

    return run


def fio_randread(path: str, engine: str, seconds: float) -> Callable[[], tuple[float, float]]:
    """fio 64 KiB random reads, direct=1, iodepth 32, time-based; returned as seconds per 1000 reads."""
    args = ["--name=randread", f"--filename={path}", "--rw=randread", "--bs=64k", "--direct=1",
            f"--ioengine={engine}", "--iodepth=32", "--time_based", f"--runtime={seconds}"]

    def run() -> tuple[float, float]:
        job, cpu = run_fio(args)
        iops = job["read"]["iops"]
        ios = job["read"]["total_ios"] or 1
        return SMALL_COUNT / iops, cpu * SMALL_COUNT / ios

    return run


# ---------------------------------------------------------------------------------------- ordering
ENGINE_WORDS = ("io_uring", "libaio", "posix", "aio_handle")


def _peer_key(c: Case) -> tuple[str, str]:
    words = [w for w in c.name.replace(",", "").split()
             if w not in ENGINE_WORDS and w not in ("locked", "plain")]
    return c.op, " ".join(words)


def _engine(c: Case) -> str:
    return next((w for w in c.name.replace(",", "").split() if w in ENGINE_WORDS), "")


def interleave_peers(cases: list[Case]) -> list[Case]:
    """Run the cases that are compared with each other back to back: deepnvme's plain tensor right after its
    locked one (same engine and settings), DeepSpeed right after deepnvme with the same settings. This disk's
    speed drifts in phases lasting several cases (a host-side limit), and a ratio is only fair within one."""
    followers = [c for c in cases
                 if c.group == "DeepSpeed" or (c.group == "deepnvme" and c.name.endswith(" plain"))]
    taken = {id(c) for c in followers}
    out: list[Case] = []
    for c in cases:
        if id(c) in taken:
            continue
        out.append(c)
        if c.group != "deepnvme":
            continue
        for f in [f for f in followers if _peer_key(f) == _peer_key(c)
                  and (f.group == "DeepSpeed" or _engine(f) == _engine(c))]:
            out.append(f)
            followers.remove(f)
    return out + followers


# ---------------------------------------------------------------------------------------- deepnvme
def handle_settings(engine: str, depth: int, threads: int) -> dict:
    """aio_handle keywords for one sequential configuration (1 MiB blocks, overlapped events)."""
    return {"block_size": 1 << 20, "queue_depth": depth, "single_submit": False, "overlap_events": True,
            "intra_op_parallelism": threads, "engine": engine}


def aio_seq(handle, tensor, path: str, op: str) -> Callable[[], tuple[float, float]]:
    """One sync_pwrite or sync_pread of the whole tensor."""
    def run() -> tuple[float, float]:
        if op == "read":
            drop_file_cache(path)
            return timed(lambda: handle.sync_pread(tensor, path))
        return timed(lambda: handle.sync_pwrite(tensor, path))

    return run


def aio_small(handle, views: list, paths: list[str], offsets: list[int],
              count_check: bool = True) -> Callable[[], tuple[float, float]]:
    """1000 async_pread calls, then one wait(): the many-small-tensors pattern of offloading.
    ``count_check=False`` for DeepSpeed, whose wait() counts its internal sub-requests."""
    def run() -> tuple[float, float]:
        def body() -> None:
            for v, p, o in zip(views, paths, offsets):
                handle.async_pread(v, p, o)
            done = handle.wait()
            if count_check and done != len(views):
                raise RuntimeError(f"wait() completed {done} of {len(views)} requests")

        return timed(body)

    return run


# ---------------------------------------------------------------------------------------- baselines
def leave_no_cache(path: str, fn: Callable[[], tuple[float, float]]) -> Callable[[], tuple[float, float]]:
    """Run a baseline, then evict its file: the gigabyte of page cache a buffered baseline leaves behind
    must not weigh on the cases that follow it."""
    def run() -> tuple[float, float]:
        try:
            return fn()
        finally:
            drop_file_cache(path)

    return run


def torch_save(tensor, path: str) -> Callable[[], tuple[float, float]]:
    """torch.save then fsync: what a user gets without deepnvme."""
    import torch

    return lambda: timed(lambda: (torch.save(tensor, path), fsync_path(path)))


def torch_load(path: str) -> Callable[[], tuple[float, float]]:
    """torch.load on a cold cache."""
    import torch

    def run() -> tuple[float, float]:
        drop_file_cache(path)
        return timed(lambda: torch.load(path))

    return run


def np_tofile(array, path: str) -> Callable[[], tuple[float, float]]:
    """numpy tofile then fsync."""
    return lambda: timed(lambda: (array.tofile(path), fsync_path(path)))


def np_fromfile(path: str) -> Callable[[], tuple[float, float]]:
    """numpy fromfile on a cold cache."""
    import numpy as np

    def run() -> tuple[float, float]:
        drop_file_cache(path)
        return timed(lambda: np.fromfile(path, dtype=np.uint8))

    return run


# ------------------------------------------------------------------------------------------- report
def summary(case: Case) -> dict:
    """min/median/max of rate (GB/s, or thousand requests/s for small) and median CPU-s per GiB."""
    secs = [s["seconds"] for s in case.samples]
    if case.op == "small":
        rates = sorted(SMALL_COUNT / s / 1e3 for s in secs)
    else:
        rates = sorted(case.nbytes / s / 1e9 for s in secs)
    cpu = statistics.median(s["cpu"] / (case.nbytes / GIB) for s in case.samples)
    return {"min": rates[0], "median": statistics.median(rates), "max": rates[-1], "cpu_per_gib": cpu,
            "n": len(rates)}


def fmt(s: dict) -> str:
    """'median (min–max)' with two decimals."""
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def best(cases: list[Case], group: str, op: str) -> tuple[Case | None, dict | None]:
    """The case of a group with the highest median for an operation."""
    pool = [(summary(c), c) for c in cases if c.group == group and c.op == op and c.samples]
    if not pool:
        return None, None
    s, c = max(pool, key=lambda p: p[0]["median"])
    return c, s


def seq_rows(names: dict[tuple[str, str], dict[str, Case]], keep: Callable[[str], bool],
             with_settings: bool) -> list[str]:
    """Table rows: write and read rate, then their CPU per GiB, for each (group, name) kept."""
    rows = []
    for (group, name), ops in names.items():
        if not keep(group):
            continue
        cells = []
        for op in ("write", "read"):
            c = ops.get(op)
            cells.append(fmt(summary(c)) if c and c.samples else "—")
        for op in ("write", "read"):
            c = ops.get(op)
            cells.append(f"{summary(c)['cpu_per_gib']:.2f}" if c and c.samples else "—")
        lead = f"| {group} | {name} | " if with_settings else f"| {name} | "
        rows.append(lead + " | ".join(cells) + " |")
    return rows


def render(cases: list[Case], meta: dict) -> str:
    """The markdown report: sequential table, ratios, small requests, baselines, notes."""
    out = [f"# deepnvme bench — {meta['when']}", "",
           f"Machine: {meta['machine']}; directory {meta['dir']} ({meta['fs']}); "
           f"{meta['size_gib']:g} GiB sequential; {meta['repeats']} interleaved repeats; "
           f"reads: {meta['read_mode']}. GB = 10^9 bytes; cells are median (min–max); CPU = CPU-seconds "
           "per GiB (median).", ""]
    out += ["## Sequential", "", "| tool | settings | write GB/s | read GB/s | write CPU | read CPU |",
            "| --- | --- | --- | --- | --- | --- |"]
    names: dict[tuple[str, str], dict[str, Case]] = {}
    for c in cases:
        if c.op in ("write", "read"):
            names.setdefault((c.group, c.name), {})[c.op] = c
    out += seq_rows(names, lambda g: g != "baseline", with_settings=True)
    out += ["", "## Ratios (medians)", ""]
    for op in ("write", "read"):
        dc, ds = best(cases, "deepnvme", op)
        fc, fs = best(cases, "fio", op)
        if ds and fs:
            out.append(f"- {op}: best deepnvme {ds['median']:.2f} GB/s ({dc.name}) / best fio "
                       f"{fs['median']:.2f} GB/s ({fc.name}) = **{ds['median'] / fs['median']:.2f}×**")
    for op in ("write", "read"):
        for settings in ("QD32 P2 locked", "QD128 P2 locked", "QD32 P2 plain"):
            d = [summary(c) for c in cases if c.group == "deepnvme" and c.op == op and c.samples
                 and c.name.endswith(settings)]
            k = [summary(c) for c in cases if c.group == "DeepSpeed" and c.op == op and c.samples
                 and c.name.endswith(settings)]
            if d and k:
                best_d = max(x["median"] for x in d)
                out.append(f"- {op} vs DeepSpeed at {settings}: deepnvme {best_d:.2f} / DeepSpeed "
                           f"{k[0]['median']:.2f} GB/s = **{best_d / k[0]['median']:.2f}×**")
    for op in ("write", "read"):
        pairs = []
        for (group, name), ops in names.items():
            if group == "deepnvme" and name.endswith(" plain") and op in ops:
                locked = names.get((group, name[: -len(" plain")] + " locked"), {}).get(op)
                if locked and locked.samples and ops[op].samples:
                    r = summary(ops[op])["median"] / summary(locked)["median"]
                    pairs.append(f"{name[: -len(' plain')]}: {r:.2f}×")
        if pairs:
            out.append(f"- plain/locked {op}: " + ", ".join(pairs))
    out += ["", f"## {SMALL_COUNT} reads of 64 KiB (thousand per second)", "",
            "| tool | settings | thousand/s | CPU-s per GiB |", "| --- | --- | --- | --- |"]
    for c in cases:
        if c.op == "small" and c.samples:
            s = summary(c)
            out.append(f"| {c.group} | {c.name} | {fmt(s)} | {s['cpu_per_gib']:.2f} |")
    def small_pool(group: str, one_file: bool) -> list[dict[str, float]]:
        return [summary(c) for c in cases if c.op == "small" and c.group == group and c.samples
                and ("one file" in c.name) == one_file]

    fs_best = [summary(c) for c in cases if c.op == "small" and c.group == "fio" and c.samples]
    out.append("")
    for label, one_file in (("one file", True), (f"{SMALL_COUNT} files", False)):
        pool = small_pool("deepnvme", one_file)
        if not pool:
            continue
        d = max(s["median"] for s in pool)
        if fs_best:
            f = max(s["median"] for s in fs_best)
            out.append(f"- {label}: best deepnvme {d:.1f} k/s / best fio randread {f:.1f} k IOPS = "
                       f"**{d / f:.2f}×**")
        theirs = small_pool("DeepSpeed", one_file)
        if theirs:
            k = max(s["median"] for s in theirs)
            out.append(f"- {label}: best deepnvme {d:.1f} k/s / best DeepSpeed {k:.1f} k/s = "
                       f"**{d / k:.2f}×**")
    out += ["", f"## Baselines ({meta['size_gib']:g} GiB, cold-cache reads, writes include fsync)", "",
            "| tool | write GB/s | read GB/s | write CPU | read CPU |", "| --- | --- | --- | --- | --- |"]
    out += seq_rows(names, lambda g: g == "baseline", with_settings=False)
    out += ["", "## Notes", ""]
    out += [f"- {n}" for n in meta["notes"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Set up the files and handles, run every case `repeats` times interleaved, print and save the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/work/benchtmp", help="directory on the disk under test (not tmpfs)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", default="1G", help="sequential file size (default 1G)")
    p.add_argument("--out", default=str(ROOT / "_bench_out" / "aio_bench"), help="prefix for .json and .md")
    p.add_argument("--fio_seconds", type=float, default=3.0, help="duration of each fio randread run")
    p.add_argument("--quick", action="store_true", help="fewer configurations (smoke test of the script)")
    p.add_argument("--rest", type=float, default=1.0, help="idle seconds before each case (default 1)")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    if args.repeats < 1:
        p.error("argument --repeats: must be at least 1")
    if args.rest < 0:
        p.error("argument --rest: must not be negative")
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="aio_bench_", dir=args.dir)
    args.t_start = time.time()
    try:
        return bench(args, size, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Inputs:
    """The files and buffers every case shares."""

    seq: str  # the sequential file (fio's random reads run over it too)
    small_one: str  # SMALL_COUNT * SMALL_SIZE bytes in one file
    small_paths: list[str]  # SMALL_COUNT files of SMALL_SIZE bytes
    owner: Any  # the handle that locked the tensors (recognised by every handle: shared registry)
    locked: Any
    plain: Any
    small_buf: Any  # locked, SMALL_COUNT * SMALL_SIZE bytes
    engines: list[str]  # kernel-queue engines available here


def make_inputs(aio: Any, size: int, work: str) -> Inputs:
    """Write the test files and allocate the locked and plain tensors."""
    import torch

    seq = os.path.join(work, "seq.bin")
    make_file(seq, size)
    small_one = os.path.join(work, "small_one.bin")
    make_file(small_one, SMALL_COUNT * SMALL_SIZE)
    small_dir = os.path.join(work, "small")
    os.mkdir(small_dir)
    blob = os.urandom(SMALL_SIZE)
    small_paths = []
    for i in range(SMALL_COUNT):
        path = os.path.join(small_dir, f"t{i:04d}.bin")
        with open(path, "wb") as f:
            f.write(blob)
        small_paths.append(path)
    os.sync()
    owner = aio.aio_handle()
    u8 = torch.empty(0, dtype=torch.uint8)
    locked = owner.new_cpu_locked_tensor(size, u8)
    plain = torch.empty(size, dtype=torch.uint8)
    plain.copy_(locked)
    small_buf = owner.new_cpu_locked_tensor(SMALL_COUNT * SMALL_SIZE, u8)
    engines = [e for e in ("io_uring", "libaio") if e in aio.available_engines()]
    return Inputs(seq, small_one, small_paths, owner, locked, plain, small_buf, engines)


def sequential_cases(aio: Any, inp: Inputs, size: int, quick: bool) -> list[Case]:
    """deepnvme writes and reads of the whole file, locked and plain tensors, over engines and settings."""
    seq_cfgs = [("io_uring", 32, 1), ("io_uring", 128, 1), ("io_uring", 32, 2), ("io_uring", 128, 2),
                ("libaio", 32, 1), ("libaio", 32, 2), ("libaio", 128, 2)]
    plain_cfgs = [("io_uring", 32, 2), ("libaio", 32, 2)]
    if quick:
        seq_cfgs, plain_cfgs = [("io_uring", 32, 2)], [("io_uring", 32, 2)]
    cases = []
    for tensor_kind, cfgs in (("locked", seq_cfgs), ("plain", plain_cfgs)):
        for engine, depth, threads in cfgs:
            if engine not in inp.engines:
                continue
            h = aio.aio_handle(**handle_settings(engine, depth, threads))
            t = inp.locked if tensor_kind == "locked" else inp.plain
            name = f"{engine} QD{depth} P{threads} {tensor_kind}"
            cases += [Case("deepnvme", name, op, aio_seq(h, t, inp.seq, op), size)
                      for op in ("write", "read")]
    return cases


def fio_cases(inp: Inputs, size: int, args: argparse.Namespace) -> list[Case]:
    """fio's sequential runs over engines, depths and jobs, and its 64 KiB random reads."""
    cases = []
    depths, jobs_list = ([32, 128], [1, 2]) if not args.quick else ([32], [1])
    for engine, fixed in [("libaio", False), ("io_uring", False), ("io_uring", True)]:
        for depth in depths:
            for jobs in jobs_list:
                name = f"{engine}{' fixedbufs' if fixed else ''} QD{depth} jobs{jobs}"
                cases += [Case("fio", name, op, fio_seq(inp.seq, size, op, engine, depth, jobs, fixed), size)
                          for op in ("write", "read")]
    for engine in ("libaio", "io_uring") if not args.quick else ("io_uring",):
        cases.append(Case("fio", f"randread 64k {engine} QD32 direct", "small",
                          fio_randread(inp.seq, engine, args.fio_seconds), SMALL_COUNT * SMALL_SIZE))
    return cases


def small_cases(aio: Any, inp: Inputs, quick: bool) -> list[Case]:
    """Many small requests: views of one locked buffer (no per-request allocation is measured), into one
    file at offsets and into as many files."""
    views = list(inp.small_buf.view(SMALL_COUNT, SMALL_SIZE).unbind(0))
    small_cfgs = [("io_uring", 32, 1), ("io_uring", 128, 1), ("io_uring", 128, 2), ("libaio", 32, 1),
                  ("libaio", 128, 2)]
    if quick:
        small_cfgs = [("io_uring", 128, 1)]
    cases, total = [], SMALL_COUNT * SMALL_SIZE
    for engine, depth, threads in small_cfgs:
        if engine not in inp.engines:
            continue
        h = aio.aio_handle(block_size=1 << 20, queue_depth=depth, single_submit=False, overlap_events=True,
                           intra_op_parallelism=threads, engine=engine)
        offsets = [i * SMALL_SIZE for i in range(SMALL_COUNT)]
        cases.append(Case("deepnvme", f"one file, {engine} QD{depth} P{threads}", "small",
                          aio_small(h, views, [inp.small_one] * SMALL_COUNT, offsets), total))
        cases.append(Case("deepnvme", f"{SMALL_COUNT} files, {engine} QD{depth} P{threads}", "small",
                          aio_small(h, views, inp.small_paths, [0] * SMALL_COUNT), total))
    return cases


def baseline_cases(aio: Any, inp: Inputs, size: int, work: str) -> list[Case]:
    """What a user would otherwise pick (torch.save/load, numpy), on their own files, and deepnvme+fsync."""
    pt, npf = os.path.join(work, "base.pt"), os.path.join(work, "base.npy")
    arr = inp.plain.numpy()
    h = aio.aio_handle(**handle_settings(inp.engines[0] if inp.engines else "posix", 32, 2))

    def aio_write_fsync() -> tuple[float, float]:
        return timed(lambda: (h.sync_pwrite(inp.locked, inp.seq), fsync_path(inp.seq)))

    return [Case("baseline", "torch.save+fsync / torch.load", "write",
                 leave_no_cache(pt, torch_save(inp.plain, pt)), size),
            Case("baseline", "torch.save+fsync / torch.load", "read",
                 leave_no_cache(pt, torch_load(pt)), size),
            Case("baseline", "numpy tofile+fsync / fromfile", "write",
                 leave_no_cache(npf, np_tofile(arr, npf)), size),
            Case("baseline", "numpy tofile+fsync / fromfile", "read",
                 leave_no_cache(npf, np_fromfile(npf)), size),
            Case("baseline", "deepnvme write+fsync (QD32 P2 locked)", "write", aio_write_fsync, size)]


def round_trip_ok(aio: Any, inp: Inputs, cases: list[Case], size: int) -> bool:
    """Correctness once, before timing: the first deepnvme write, read back and compared."""
    import torch

    cases[0].run()
    back = torch.empty(size, dtype=torch.uint8)
    reader = aio.aio_handle(**handle_settings(inp.engines[0] if inp.engines else "posix", 32, 2))
    reader.sync_pread(back, inp.seq)
    return bool(torch.equal(back, inp.locked))


def measure(cases: list[Case], repeats: int, rest: float, log: Callable[[str], None]) -> float:
    """Run every case `repeats` times, interleaved; returns the seconds it took."""
    started = time.time()
    for r in range(repeats):
        # Alternate the order each repeat so slow drift of a shared machine does not favour one side.
        order = cases if r % 2 == 0 else list(reversed(cases))
        for i, c in enumerate(order):
            log(f"repeat {r + 1}/{repeats} [{i + 1}/{len(order)}] {c.group} {c.name} {c.op}")
            # Rest first: a virtual disk may run fast until a long stretch of transfers drains a host-side
            # allowance, then hold a lower plateau until it idles; without a rest, whoever runs late in a
            # stretch measures the plateau, not the software.
            time.sleep(rest)
            result = c.run()
            if result is None:  # a DeepSpeed case that failed: its note says why
                continue
            secs, cpu = result
            c.samples.append({"seconds": secs, "cpu": cpu, "repeat": r})
    return time.time() - started


def write_outputs(cases: list[Case], meta: dict, out: Path) -> None:
    """Print the Markdown table and write it, with every sample as JSON, beside --out."""
    report = render(cases, meta)
    print(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "cases": [{"group": c.group, "name": c.name, "op": c.op, "bytes": c.nbytes,
                                  "samples": c.samples, "summary": summary(c) if c.samples else None}
                                 for c in cases]}, indent=1))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)


def bench(args: argparse.Namespace, size: int, work: str) -> int:
    """Everything after argument parsing; `work` is removed by the caller."""
    import torch

    from deepnvme import AsyncIOBuilder

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress goes to stderr
    aio = AsyncIOBuilder().load()
    log(f"setup: {size / GIB:g} GiB file, {SMALL_COUNT} small files in {work}")
    inp = make_inputs(aio, size, work)
    notes = [f"plain tensor address mod 4096 = {inp.plain.data_ptr() % 4096} (torch.empty as allocated)"]
    cases = sequential_cases(aio, inp, size, args.quick)
    if shutil.which("fio"):
        cases += fio_cases(inp, size, args)
    else:
        notes.append("fio is not on PATH: no fio rows")
    cases += small_cases(aio, inp, args.quick) + baseline_cases(aio, inp, size, work)

    # DeepSpeed in a process of its own, like fio (see bench/deepspeed_side.py for why).
    from deepspeed_side import DeepSpeedSide

    side = DeepSpeedSide(inp.seq, size, inp.small_one, inp.small_paths)
    if side.error:
        notes.append(f"DeepSpeed: not measured ({side.error})")
    else:
        notes.append("DeepSpeed rows: measured in a child process of their own, same files and settings")
        cases += [Case("DeepSpeed", name, op, side.runner(i), nbytes)
                  for i, (name, op, nbytes) in enumerate(side.cases)]
    cases = interleave_peers(cases)
    if not round_trip_ok(aio, inp, cases, size):
        print("deepnvme round trip mismatch: results would be meaningless", file=sys.stderr)
        return 1

    elapsed = measure(cases, args.repeats, args.rest, log)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.node()}, {os.cpu_count()} CPUs, "
            f"{platform.release()}", "dir": args.dir, "fs": mount_of(args.dir)[1] or "?",
            "size_gib": size / GIB,
            "repeats": args.repeats, "read_mode": DESCRIPTIONS[read_mode(args.dir)], "notes": notes,
            "seconds": elapsed, "torch": torch.__version__}
    notes.append(f"{args.rest:g} s of rest before each case (--rest)")
    notes.append(f"measuring took {elapsed:.0f} s ({time.time() - args.t_start:.0f} s with set-up); "
                 f"deepnvme engines available: {', '.join(inp.engines)}")
    notes.append("fio rows: bandwidth as fio reports it (its start-up excluded); fio CPU includes its "
                 "start-up. deepnvme rows: one sync_pwrite/sync_pread of the whole tensor, no fsync.")
    write_outputs(cases, meta, Path(args.out))
    side.close()
    if side.failure:
        notes.append(f"DeepSpeed: stopped measuring after a failure ({side.failure})")
    inp.owner.free_cpu_locked_tensor(inp.small_buf)
    inp.owner.free_cpu_locked_tensor(inp.locked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
