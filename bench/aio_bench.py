#!/usr/bin/env python3
"""deepnvme beside fio on one grid of settings, with DeepSpeed, torch.save/load and numpy, in one run.

    python3 bench/aio_bench.py [--dir /work/benchtmp] [--sizes 64M,256M,1G,4G] [--repeats 3]
                               [--deepspeed_python /work/dsvenv/bin/python] [--quick] [--out PREFIX]

The grid: block 1 MiB and 8 MiB x queue depth 32 and 128 x 1 and 2 threads (the handle's
intra_op_parallelism) or jobs (fio's numjobs), at every --sizes size. At each point the handle writes and
reads the whole size with one sync_pwrite / sync_pread (open included in the time), from a locked tensor and
from a plain ``torch.empty`` one, and fio does the same with its twin engine, through the command
deepnvme.tools.tune.fio builds: one file for every job (--offset_increment), the same file layout (written in
full before any case, overwritten in place by both), O_DIRECT on both sides, the page cache dropped before
every read. The contenders at one point run back to back in an order that rotates every repeat, and the
points run in an order that reverses every repeat; cells are medians. fio's own bandwidth leaves out its
file open and thread start; the handle's time cannot.

Also measured: 1000 reads of 64 KiB queued with async_pread and drained by one wait() (one file and 1000
files) beside fio's 64 KiB randread; torch.save+fsync / torch.load and numpy tofile+fsync / fromfile on a cold
cache; DeepSpeed's aio_handle at the grid's two-thread points, in a process of its own
(bench/deepspeed_side.py) started with --deepspeed_python.

GB = 10^9 bytes; CPU = user+system seconds of this process (handle, baselines) or of fio and its jobs
(rusage, start-up included) per GiB moved. Writes Markdown to stdout and <out>.md, every sample to <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import ROOT, children_cpu, interleave, timed  # first: puts this checkout on sys.path
from aio_cases import MIB, SMALL_COUNT, SMALL_SIZE, Setting, aio_seq, aio_small, handle_settings

from deepnvme._core.aio_types import AioModule  # noqa: E402
from deepnvme.filesystem import fsync_path, mount_of  # noqa: E402
from deepnvme.tools.pagecache import DESCRIPTIONS, drop_file_cache, read_mode  # noqa: E402
from deepnvme.tools.resident import touch_pages  # noqa: E402
from deepnvme.tools.sizes import format_size, parse_size  # noqa: E402
from deepnvme.tools.tune.fio import (  # noqa: E402
    MISMATCH,
    MISMATCH_CAUSES,
    fio_command,
    fio_shares,
    lay_out,
    layout_of,
    mismatch_warning,
    run_fio_command,
)

GIB = 1 << 30
GRID_BLOCKS = (1 * MIB, 8 * MIB)
GRID_DEPTHS = (32, 128)
GRID_JOBS = (1, 2)
#: DeepSpeed's points: every two-thread point with a locked tensor, queue depth 128 with a plain one (its
#: plain path allocates a bounce buffer per request and is slow enough to dominate the run otherwise).
DS_LOCKED = [(b, d, 2) for b in GRID_BLOCKS for d in GRID_DEPTHS]
DS_PLAIN = [(b, 128, 2) for b in GRID_BLOCKS]
#: the targets for best handle / best fio, by size (the largest threshold not above the size), as the README's
#: I/O grid table states them
TARGETS = ((GIB, 0.95), (256 * MIB, 0.9), (64 * MIB, 0.8))
DEFAULT_SIZES = "64M,256M,1G,4G"
LONG = 4 * GIB  # sizes from here on get --long_repeats
QUICK_SIZES = "64M,1G"


def grid() -> list[Setting]:
    """The grid every sequential contender is measured on."""
    return [Setting(b, d, j) for b in GRID_BLOCKS for d in GRID_DEPTHS for j in GRID_JOBS]


@dataclass
class Case:
    """One measured thing. `run` returns (seconds, cpu seconds), or None when it could not be measured."""

    group: str  # deepnvme | fio | DeepSpeed | baseline
    name: str  # the contender within its group, e.g. "io_uring locked"
    op: str  # write | read | small
    run: Callable[[], tuple | None]  # (seconds, cpu seconds[, extra sample fields])
    nbytes: int
    size: int = 0  # the --sizes entry it belongs to (0: none)
    setting: Setting | None = None
    kind: str = ""  # locked | plain, for handles
    path: str = ""  # a file whose layout must not change under the case
    samples: list[dict] = field(default_factory=list)
    layout_changes: int = 0


# ---------------------------------------------------------------------------------------- deepnvme
# --------------------------------------------------------------------------------------------- fio
def fio_seq(path: str, op: str, engine: str, s: Setting, total: int) -> Callable[[], tuple]:
    """fio at a grid point (see deepnvme.tools.tune.fio for what makes it the same as the handle's run).
    CPU: what fio reports for its jobs' transfer; the rusage of fio and its jobs (start-up and set-up
    included) goes to the sample as cpu_rusage."""
    cmd = fio_command(path, op, engine, s.block, s.depth, s.jobs, total)

    def run() -> tuple[float, float]:
        if op == "read":
            drop_file_cache(path)
        r = run_fio_command(cmd)
        return r.seconds, r.cpu_reported, {"cpu_rusage": r.cpu, "fixedbufs": r.fixedbufs,
                                           "fio_own_seconds": r.fio_seconds}

    return run


def fio_randread(path: str, engine: str, seconds: float) -> Callable[[], tuple[float, float]]:
    """fio 64 KiB random reads, direct=1, iodepth 32, time-based; returned as seconds per 1000 reads."""
    cmd = ["fio", "--output-format=json", "--name=randread", f"--filename={path}", "--rw=randread",
           "--bs=64k", "--direct=1", f"--ioengine={engine}", "--iodepth=32", "--time_based",
           f"--runtime={seconds}"]

    def run() -> tuple[float, float]:
        import subprocess

        c0 = children_cpu()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, check=False)
        cpu = children_cpu() - c0
        if proc.returncode != 0:
            raise RuntimeError(f"fio randread failed: {proc.stderr.strip() or proc.stdout.strip()}")
        job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
        ios = job["read"]["total_ios"] or 1
        return SMALL_COUNT / job["read"]["iops"], cpu * SMALL_COUNT / ios

    return run


# ---------------------------------------------------------------------------------------- baselines
def leave_no_cache(path: str, fn: Callable[[], tuple[float, float]]) -> Callable[[], tuple[float, float]]:
    """Run a baseline, then evict its file: the page cache a buffered baseline leaves behind must not weigh
    on the cases that follow it."""
    def run() -> tuple[float, float]:
        try:
            return fn()
        finally:
            drop_file_cache(path)

    return run


def baseline_cases(aio: AioModule, size: int, plain: Any, locked: Any, seq: str, engine: str, work: str
                   ) -> list[list[Case]]:
    """torch.save+fsync / torch.load, numpy tofile+fsync / fromfile, and the handle's write + fsync; one
    heat per direction."""
    import numpy as np
    import torch

    pt, npf = os.path.join(work, "base.pt"), os.path.join(work, "base.npy")
    arr = plain.numpy()
    h = aio.aio_handle(**handle_settings(engine, 128, 2, 8 * MIB))

    def load(path: str, fn: Callable[[], object]) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            drop_file_cache(path)
            return timed(fn)
        return run

    def resident(t: Any, fn: Callable[[], tuple[float, float]]) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            touch_pages(t)  # as aio_seq does: the source's pages resident before the clock
            return fn()
        return run

    writes = [Case("baseline", "torch.save+fsync / torch.load", "write",
                   leave_no_cache(pt, resident(plain, lambda: timed(lambda: (torch.save(plain, pt),
                                                                             fsync_path(pt))))), size, size),
              Case("baseline", "numpy tofile+fsync / fromfile", "write",
                   leave_no_cache(npf, resident(plain, lambda: timed(
                       lambda: (arr.tofile(npf), fsync_path(npf))))), size, size),
              Case("baseline", f"deepnvme write+fsync ({engine} bs 8M QD128 x2, locked)", "write",
                   resident(locked, lambda: timed(lambda: (h.sync_pwrite(locked, seq), fsync_path(seq)))),
                   size, size)]
    reads = [Case("baseline", "torch.save+fsync / torch.load", "read",
                  leave_no_cache(pt, load(pt, lambda: torch.load(pt))), size, size),
             Case("baseline", "numpy tofile+fsync / fromfile", "read",
                  leave_no_cache(npf, load(npf, lambda: np.fromfile(npf, dtype=np.uint8))), size, size)]
    return [writes, reads]


# ---------------------------------------------------------------------------------------- measuring
def measure(heats: list[list[Case]], repeats: int, rest: float, log: Callable[[str], None]) -> float:
    """Run every heat `repeats` times in the harness's interleaved order (heats reversed, contenders rotated
    every repeat). Returns the seconds it took."""
    started = time.time()
    for r, i, c in interleave(heats, repeats):
        log(f"repeat {r + 1}/{repeats} [{i + 1}/{len(heats)}] {c.group} {c.name} {c.op}"
            + (f" {c.setting.label()}" if c.setting else "")
            + (f" {format_size(c.size)}" if c.size else ""))
        # Rest first: a virtual disk may run fast until a long stretch of transfers drains a host-side
        # allowance, then hold a lower plateau until it idles. The rest scales with the bytes moved, so that
        # small sizes are not mostly rest.
        time.sleep(rest * min(1.0, c.nbytes / GIB))
        before = layout_of(c.path) if c.path else None
        result = c.run()
        if c.path and layout_of(c.path) != before:
            c.layout_changes += 1
        if result is None:  # a DeepSpeed case that failed: its note says why
            continue
        secs, cpu, *extra = result
        c.samples.append({"seconds": secs, "cpu": cpu, "repeat": r, **(extra[0] if extra else {})})
    return time.time() - started


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


def target_for(size: int) -> float | None:
    """The best-handle/best-fio target at a size, or None below 64 MiB."""
    return next((t for s, t in TARGETS if size >= s), None)


# ------------------------------------------------------------------------------------------- report
def fmt(s: dict) -> str:
    """'median (min–max)' with two decimals."""
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def med(c: Case | None) -> float | None:
    return summary(c)["median"] if c is not None and c.samples else None


def ratio_text(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "—"


def find(cases: list[Case], **want: Any) -> Case | None:
    """The first case whose attributes equal `want`."""
    return next((c for c in cases if all(getattr(c, k) == v for k, v in want.items())), None)


def best(cases: list[Case], group: str, op: str, size: int) -> Case | None:
    """The case of a group with the highest median for an operation at a size."""
    pool = [c for c in cases if c.group == group and c.op == op and c.size == size and c.samples
            and c.setting is not None]
    return max(pool, key=lambda c: summary(c)["median"]) if pool else None


def size_analysis(cases: list[Case], size: int, engines: list[str]) -> dict:
    """Per op at one size: best handle and best fio (their settings), the ratio and target, plain/locked per
    block size, same-settings ratios with their warnings, CPU per GiB, DeepSpeed ratios."""
    out: dict[str, Any] = {"size": size, "target": target_for(size)}
    warnings: list[str] = []
    for op in ("write", "read"):
        d, f = best(cases, "deepnvme", op, size), best(cases, "fio", op, size)
        res: dict[str, Any] = {}
        if d and f:
            res.update(best_deepnvme=med(d), best_deepnvme_at=f"{d.name}, {d.setting.label()}",
                       best_fio=med(f), best_fio_at=f"{f.name}, {f.setting.label()}", ratio=med(d) / med(f))
        same, per_block = [], {}
        for s in grid():
            for e in engines:
                lk = find(cases, group="deepnvme", name=f"{e} locked", op=op, size=size, setting=s)
                pl = find(cases, group="deepnvme", name=f"{e} plain", op=op, size=size, setting=s)
                fi = find(cases, group="fio", name=e, op=op, size=size, setting=s)
                if med(lk) and med(fi):
                    r = med(lk) / med(fi)
                    same.append({"setting": s.label(), "engine": e, "locked_over_fio": r})
                    w = mismatch_warning(f"{format_size(size)} {op} {e} {s.label()} (locked tensor)", r)
                    if w:
                        warnings.append(w)
                if med(lk) and med(pl):
                    per_block.setdefault(s.block, []).append(med(pl) / med(lk))
        res["same_settings"] = same
        res["plain_over_locked"] = {}
        for block, ratios in per_block.items():
            lk_best = max(med(c) for c in cases if c.group == "deepnvme" and c.kind == "locked" and c.op == op
                          and c.size == size and c.setting and c.setting.block == block and c.samples)
            pl_best = max(med(c) for c in cases if c.group == "deepnvme" and c.kind == "plain" and c.op == op
                          and c.size == size and c.setting and c.setting.block == block and c.samples)
            res["plain_over_locked"][format_size(block)] = {"best_over_best": pl_best / lk_best,
                                                            "min": min(ratios), "max": max(ratios)}
        cpu: dict[str, float] = {}
        for label, group, kind in (("deepnvme locked", "deepnvme", "locked"), ("deepnvme plain", "deepnvme",
                                   "plain"), ("fio", "fio", ""), ("DeepSpeed locked", "DeepSpeed", "locked"),
                                   ("DeepSpeed plain", "DeepSpeed", "plain")):
            vals = [summary(c)["cpu_per_gib"] for c in cases if c.group == group and c.kind == kind
                    and c.op == op and c.size == size and c.samples and c.setting]
            if vals:
                cpu[label] = statistics.median(vals)
        rus = [statistics.median(x["cpu_rusage"] for x in c.samples) / (c.nbytes / GIB) for c in cases
               if c.group == "fio" and c.op == op and c.size == size and c.samples and c.setting]
        if rus:
            cpu["fio rusage"] = statistics.median(rus)
        res["cpu_per_gib_median"] = cpu
        ds = []
        for c in cases:
            if c.group == "DeepSpeed" and c.op == op and c.size == size and c.samples:
                ours = [find(cases, group="deepnvme", name=f"{e} {c.kind}", op=op, size=size,
                             setting=c.setting) for e in engines]
                top = max((med(x) for x in ours if med(x)), default=None)
                if top:
                    ds.append({"setting": c.setting.label(), "kind": c.kind, "deepnvme_over_deepspeed":
                               top / med(c)})
        res["deepspeed"] = ds
        out[op] = res
    out["warnings"] = warnings
    return out


def render_size(cases: list[Case], size: int, a: dict) -> list[str]:
    """One size's section: a table per op, then the ratios and warnings."""
    out = [f"## {format_size(size)}", ""]
    for op in ("write", "read"):
        cols = list(dict.fromkeys((c.group, c.name) for c in cases if c.size == size and c.op == op
                                  and c.setting is not None))
        out += [f"{op} GB/s, median (min–max); CPU-s/GiB in the last columns:", "",
                "| settings | " + " | ".join(f"{g} {n}" for g, n in cols) + " | "
                + " | ".join(f"CPU {g} {n}" for g, n in cols) + " |",
                "| --- " * (1 + 2 * len(cols)) + "|"]
        for s in grid():
            row = [find(cases, group=g, name=n, op=op, size=size, setting=s) for g, n in cols]
            cells = [fmt(summary(c)) if c and c.samples else "—" for c in row]
            cpus = [f"{summary(c)['cpu_per_gib']:.2f}" if c and c.samples else "—" for c in row]
            out.append(f"| {s.label()} | " + " | ".join(cells + cpus) + " |")
        out.append("")
        r = a[op]
        if "ratio" in r:
            t = a["target"]
            verdict = f" (target ≥ {t:.2f}: {'met' if r['ratio'] >= t else 'NOT met'})" if t else ""
            out.append(f"- {op}: best deepnvme {r['best_deepnvme']:.2f} GB/s ({r['best_deepnvme_at']}) "
                       f"/ best fio {r['best_fio']:.2f} GB/s ({r['best_fio_at']}) = **{r['ratio']:.2f}×**"
                       + verdict)
        if r["plain_over_locked"]:
            out.append(f"- {op} plain/locked, best plain over best locked per block size (range over the "
                       "block's points): " + ", ".join(
                           f"{b}: {v['best_over_best']:.2f}× ({v['min']:.2f}–{v['max']:.2f})"
                           for b, v in r["plain_over_locked"].items()))
        if r["same_settings"]:
            vals = [x["locked_over_fio"] for x in r["same_settings"]]
            out.append(f"- {op} deepnvme locked / fio at the same settings: {min(vals):.2f}–{max(vals):.2f}×")
        if r["deepspeed"]:
            out.append(f"- {op} deepnvme / DeepSpeed at the same settings: " + ", ".join(
                f"{x['setting']} {x['kind']} {x['deepnvme_over_deepspeed']:.2f}×" for x in r["deepspeed"]))
        if r["cpu_per_gib_median"]:
            out.append(f"- {op} CPU-s/GiB (median over the grid): " + ", ".join(
                f"{k} {v:.3f}" for k, v in r["cpu_per_gib_median"].items()))
        out.append("")
    out += a["warnings"] + ([MISMATCH_CAUSES, ""] if a["warnings"] else [])
    base = [c for c in cases if c.group == "baseline" and c.size == size and c.samples]
    if base:
        out += [f"Baselines at {format_size(size)} (cold-cache reads, writes include fsync):", "",
                "| tool | op | GB/s | CPU-s/GiB |", "| --- | --- | --- | --- |"]
        out += [f"| {c.name} | {c.op} | {fmt(summary(c))} | {summary(c)['cpu_per_gib']:.2f} |" for c in base]
        out.append("")
    return out


def render(cases: list[Case], analyses: list[dict], meta: dict) -> str:
    """The Markdown report: the summary over sizes, each size's tables, small requests, notes."""
    out = [f"# deepnvme aio bench — {meta['when']}", "",
           f"Machine: {meta['machine']}; directory {meta['dir']} ({meta['fs']}); reads: {meta['read_mode']}; "
           "repeats per size: " + ", ".join(f"{k} {v}" for k, v in meta["repeats"].items())
           + ". GB = 10^9 bytes.", "",
           "## Summary: best deepnvme / best fio over the grid "
           f"(bs {'/'.join(format_size(b) for b in GRID_BLOCKS)} × QD {'/'.join(map(str, GRID_DEPTHS))} × "
           f"{'/'.join(map(str, GRID_JOBS))} threads/jobs)", "",
           "| size | write | read | target | write plain/locked per bs | read plain/locked per bs | "
           "CPU-s/GiB write (locked / plain / fio) | CPU-s/GiB read (locked / plain / fio) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in analyses:
        cells = [format_size(a["size"])]
        cells += [f"{a[op]['ratio']:.2f}" if "ratio" in a[op] else "—" for op in ("write", "read")]
        cells.append(f"≥ {a['target']:.2f}" if a["target"] else "—")
        cells += [", ".join(f"{b} {v['best_over_best']:.2f}" for b, v in a[op]["plain_over_locked"].items())
                  or "—" for op in ("write", "read")]
        for op in ("write", "read"):
            c = a[op]["cpu_per_gib_median"]
            cells.append(" / ".join(f"{c[k]:.3f}" if k in c else "—"
                                    for k in ("deepnvme locked", "deepnvme plain", "fio")))
        out.append("| " + " | ".join(cells) + " |")
    n_warn = sum(len(a["warnings"]) for a in analyses)
    out += ["", f"{n_warn} same-settings ratio(s) beyond {MISMATCH:g}× either way (listed under each size)."
            if n_warn else f"Every same-settings deepnvme/fio ratio is within {MISMATCH:g}× either way.", ""]
    for a in analyses:
        out += render_size(cases, a["size"], a)
    small = [c for c in cases if c.op == "small" and c.samples]
    if small:
        out += [f"## {SMALL_COUNT} reads of 64 KiB (thousand per second)", "",
                "| tool | settings | thousand/s | CPU-s per GiB |", "| --- | --- | --- | --- |"]
        out += [f"| {c.group} | {c.name} | {fmt(summary(c))} | {summary(c)['cpu_per_gib']:.2f} |"
                for c in small]
        fio_best = max((summary(c)["median"] for c in small if c.group == "fio"), default=None)
        out.append("")
        for label in ("one file", f"{SMALL_COUNT} files"):
            ours, theirs = ([summary(c)["median"] for c in small if c.group == g and c.name.startswith(label)]
                            for g in ("deepnvme", "DeepSpeed"))
            if ours and fio_best:
                out.append(f"- {label}: best deepnvme {max(ours):.1f} k/s / best fio randread "
                           f"{fio_best:.1f} k IOPS = **{max(ours) / fio_best:.2f}×**")
            if ours and theirs:
                out.append(f"- {label}: best deepnvme / best DeepSpeed = **{max(ours) / max(theirs):.2f}×**")
        out.append("")
    out += ["## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------- setup
@dataclass
class SizeRun:
    """The file, tensors and handles of one size, and the heats measured on them."""

    path: str
    owner: Any
    locked: Any
    plain: Any
    heats: list[list[Case]]
    side: Any = None


def size_run(aio: AioModule, args: argparse.Namespace, size: int, work: str, engines: list[str],
             log: Callable[[str], None]) -> SizeRun:
    """Lay out the size's file, allocate its tensors, and build a heat per grid point and op."""
    import torch

    path = os.path.join(work, f"seq_{format_size(size)}.bin")
    log(f"setup {format_size(size)}: laying out {path}")
    lay_out(path, size)
    owner = aio.aio_handle()
    locked = owner.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    pattern = torch.randint(0, 256, (min(size, 64 * MIB),), dtype=torch.uint8)
    for off in range(0, size, len(pattern)):
        n = min(len(pattern), size - off)
        locked[off:off + n].copy_(pattern[:n])
    plain = torch.empty(size, dtype=torch.uint8)
    plain.copy_(locked)
    side = None
    if "deepspeed" in args.sections and size == args.ds_size:
        from deepspeed_side import DeepSpeedSide

        side = DeepSpeedSide(args.deepspeed_python, seq=path, size=size,
                             grid=[[*p, "locked"] for p in DS_LOCKED] + [[*p, "plain"] for p in DS_PLAIN])
    heats: list[list[Case]] = []
    if "grid" in args.sections:
        for s in grid():
            share, _ = fio_shares(size, s.jobs, s.block)
            total = share * s.jobs  # what fio moves; the handle gets a view of the same length
            handles = {e: aio.aio_handle(**handle_settings(e, s.depth, s.jobs, s.block)) for e in engines}
            for op in ("write", "read"):
                heat = []
                for e in engines:
                    for kind, t in (("locked", locked), ("plain", plain)):
                        heat.append(Case("deepnvme", f"{e} {kind}", op,
                                         aio_seq(handles[e], t[:total], path, op), total, size, s, kind,
                                         path))
                    heat.append(Case("fio", e, op, fio_seq(path, op, e_fio(e), s, total), total, size, s, "",
                                     path))
                if side is not None and not side.error:
                    heat += [Case("DeepSpeed", f"aio_handle {kind}", op, side.runner(i), nbytes, size, s,
                                  kind, path)
                             for i, (block, depth, jobs, kind, cop, nbytes) in enumerate(side.cases)
                             if (block, depth, jobs) == (s.block, s.depth, s.jobs) and cop == op]
                heats.append(heat)
    if "baseline" in args.sections and size == args.baseline_size:
        heats += baseline_cases(aio, size, plain, locked, path, engines[0], work)
    return SizeRun(path, owner, locked, plain, heats, side)


def spent() -> None:
    """Case.run of a case whose size is done (its tensors are freed)."""
    return None


def e_fio(engine: str) -> str:
    """fio's --ioengine for a handle engine (the engine catalogue's twin)."""
    from op_builder.engines import by_name

    return by_name(engine).fio


def small_heats(aio: AioModule, args: argparse.Namespace, work: str, engines: list[str],
                log: Callable[[str], None]) -> tuple[list[list[Case]], Any, Any, Any]:
    """1000 reads of 64 KiB: views of one locked buffer (no per-request allocation is measured), from one
    file at offsets and from as many files; fio's randread over the one file; DeepSpeed's when asked."""
    import torch

    log(f"setup: {SMALL_COUNT} small files in {work}")
    small_one = os.path.join(work, "small_one.bin")
    lay_out(small_one, SMALL_COUNT * SMALL_SIZE)
    small_dir = os.path.join(work, "small")
    os.mkdir(small_dir)
    blob = os.urandom(SMALL_SIZE)
    paths = []
    for i in range(SMALL_COUNT):
        p = os.path.join(small_dir, f"t{i:04d}.bin")
        with open(p, "wb") as f:
            f.write(blob)
        paths.append(p)
    os.sync()
    owner = aio.aio_handle()
    buf = owner.new_cpu_locked_tensor(SMALL_COUNT * SMALL_SIZE, torch.empty(0, dtype=torch.uint8))
    views = list(buf.view(SMALL_COUNT, SMALL_SIZE).unbind(0))
    cfgs = [(e, d, t) for e in engines for d, t in ((32, 1), (128, 2))]
    if args.quick:
        cfgs = cfgs[1:2]
    total = SMALL_COUNT * SMALL_SIZE
    one_file, many_files = [], []
    for engine, depth, threads in cfgs:
        h = aio.aio_handle(**handle_settings(engine, depth, threads))
        one_file.append(Case("deepnvme", f"one file, {engine} QD{depth} P{threads}", "small",
                             aio_small(h, views, [small_one] * SMALL_COUNT,
                                       [i * SMALL_SIZE for i in range(SMALL_COUNT)]), total))
        many_files.append(Case("deepnvme", f"{SMALL_COUNT} files, {engine} QD{depth} P{threads}", "small",
                               aio_small(h, views, paths, [0] * SMALL_COUNT), total))
    for engine in engines:
        one_file.append(Case("fio", f"randread 64k {e_fio(engine)} QD32 direct, over the one file", "small",
                             fio_randread(small_one, e_fio(engine), args.fio_seconds), total))
    side = None
    if "deepspeed" in args.sections:
        from deepspeed_side import DeepSpeedSide

        side = DeepSpeedSide(args.deepspeed_python, small_one=small_one, small_paths=paths)
        if not side.error:
            for i, (_, _, _, name, _, nbytes) in enumerate(side.cases):
                (one_file if name.startswith("one file") else many_files).append(
                    Case("DeepSpeed", name, "small", side.runner(i), nbytes))
    return [one_file, many_files], owner, buf, side


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; --quick changes the defaults of --sizes and --repeats only."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/work/benchtmp", help="directory on the disk under test (not tmpfs)")
    p.add_argument("--sizes", default=None,
                   help=f"comma list of sequential sizes (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; --quick: 1)")
    p.add_argument("--long_repeats", type=int, default=2,
                   help="repeats at sizes of 4 GiB and more, at most --repeats (default 2: each sample there "
                        "lasts seconds and varies less, and this keeps the default run near 12-15 minutes)")
    p.add_argument("--sections", default="grid,small,baseline,deepspeed",
                   help="comma list of grid, small, baseline, deepspeed (default: all)")
    p.add_argument("--deepspeed_python", default=sys.executable,
                   help="interpreter that can `import deepspeed` (e.g. /work/dsvenv/bin/python)")
    p.add_argument("--ds_size", default="1G", help="the size DeepSpeed's grid rows run at (default 1G)")
    p.add_argument("--baseline_size", default="1G", help="the size the baselines run at (default 1G)")
    p.add_argument("--engines", default="", help="handle engines, comma list (default: auto's first pick)")
    p.add_argument("--out", default=str(ROOT / "_bench_out" / "aio_bench"), help="prefix for .json and .md")
    p.add_argument("--fio_seconds", type=float, default=3.0, help="duration of each fio randread run")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 1 repeat, fewer small cases")
    p.add_argument("--rest", type=float, default=0.5,
                   help="idle seconds before each case, scaled by its bytes / 1 GiB up to 1 (default 0.5)")
    args = p.parse_args(argv)
    try:
        sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
        args.size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
        args.ds_size = parse_size(args.ds_size)
        args.baseline_size = parse_size(args.baseline_size)
    except ValueError as exc:
        p.error(f"argument --sizes/--ds_size/--baseline_size: {exc}")
    if not args.size_list:
        p.error("argument --sizes: no size given")
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.repeats < 1:
        p.error("argument --repeats: must be at least 1")
    if args.long_repeats < 1:
        p.error("argument --long_repeats: must be at least 1")
    if args.rest < 0:
        p.error("argument --rest: must not be negative")
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    bad = args.sections - {"grid", "small", "baseline", "deepspeed"}
    if bad:
        p.error(f"argument --sections: unknown {', '.join(sorted(bad))}")
    if args.ds_size not in args.size_list:
        args.ds_size = min(args.size_list, key=lambda s: abs(s - GIB))  # the nearest size that runs
    if args.baseline_size not in args.size_list:
        args.baseline_size = min(args.size_list, key=lambda s: abs(s - GIB))
    return args


def main(argv: list[str] | None = None) -> int:
    """Set up, run every section with interleaved repeats, print and save the report."""
    args = parse_args(argv)
    if not shutil.which("fio"):
        print("fio is not on PATH: this bench compares with fio (install fio)", file=sys.stderr)
        return 1
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="aio_bench_", dir=args.dir)
    try:
        return bench(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench(args: argparse.Namespace, work: str) -> int:
    """Everything after argument parsing; `work` is removed by the caller."""
    import torch

    from deepnvme import AsyncIOBuilder

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress goes to stderr
    t_start = time.time()
    aio = AsyncIOBuilder().load()
    available = [e for e in ("io_uring", "libaio") if e in aio.available_engines()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()] or available[:1]
    if not engines or any(e not in aio.available_engines() for e in engines):
        print(f"engines {engines} not available here (available: {list(aio.available_engines())})",
              file=sys.stderr)
        return 1
    notes: list[str] = []
    cases: list[Case] = []
    analyses: list[dict] = []
    seconds: dict[str, float] = {}
    repeats: dict[str, int] = {}
    for size in args.size_list:
        run = size_run(aio, args, size, work, engines, log)
        if run.side is not None and run.side.error:
            notes.append(f"DeepSpeed: not measured ({run.side.error})")
        if size == args.size_list[0]:
            notes.append(f"plain tensor address mod 4096 = {run.plain.data_ptr() % 4096} "
                         "(torch.empty as allocated)")
        if not round_trip_ok(aio, run, engines[0]):
            print("deepnvme round trip mismatch: results would be meaningless", file=sys.stderr)
            return 1
        t0 = time.time()
        repeats[format_size(size)] = args.repeats if size < LONG else min(args.repeats, args.long_repeats)
        measure(run.heats, repeats[format_size(size)], args.rest, log)
        seconds[format_size(size)] = time.time() - t0
        for heat in run.heats:
            cases += heat
        if run.side is not None:
            run.side.close()
            if run.side.failure:
                notes.append(f"DeepSpeed: stopped measuring after a failure ({run.side.failure})")
        for heat in run.heats:
            for c in heat:
                c.run = spent  # drop the closures: they hold this size's tensors and handles
        run.owner.free_cpu_locked_tensor(run.locked)
        del run
        os.unlink(os.path.join(work, f"seq_{format_size(size)}.bin"))
        analyses.append(size_analysis(cases, size, engines))
    if "small" in args.sections:
        heats, owner, buf, side = small_heats(aio, args, work, engines, log)
        if side is not None and side.error:
            notes.append(f"DeepSpeed small requests: not measured ({side.error})")
        t0 = time.time()
        measure(heats, args.repeats, args.rest, log)
        seconds["small"] = time.time() - t0
        for heat in heats:
            cases += heat
        if side is not None:
            side.close()
        owner.free_cpu_locked_tensor(buf)
    changed = [c for c in cases if c.layout_changes]
    unfixed = sum(1 for c in cases for x in c.samples if x.get("fixedbufs") is False and c.name == "io_uring")
    if unfixed:
        notes.append(f"{unfixed} fio io_uring run(s) were refused --fixedbufs (RLIMIT_MEMLOCK below "
                     "bs x iodepth without CAP_IPC_LOCK) and ran without: their reads include "
                     "first-touch page faults.")
    own = [(x["fio_own_seconds"], x["seconds"]) for c in cases if c.group == "fio" and c.setting
           and c.setting.jobs > 1 for x in c.samples if x.get("fio_own_seconds")]
    if own:
        notes.append("fio with several jobs is timed from the first request any job issued to the last one "
                     "completed (its per-request latency log), as the handle is: fio's own group figure "
                     "clocks each job from the end of its own set-up and took the jobs to overlap; over "
                     f"{len(own)} runs a transfer took {statistics.median(s / o for o, s in own):.2f}x as "
                     f"long as fio's own figure says (median; {min(s / o for o, s in own):.2f}-"
                     f"{max(s / o for o, s in own):.2f}x; fio_own_seconds in the JSON).")
    notes += [
        "Every deepnvme and DeepSpeed tensor has its pages touched before its clock starts "
        "(deepnvme.tools.resident): on a VM the host may reclaim idle guest memory while fio allocates, and "
        "the next touch then waits for the host, booked as CPU time of the staging copies "
        "(bench/results/fio_methodology.md).",
        "Same file layout for every contender: each size's file is written in full (buffered, fsynced, "
        "evicted) before any case, and both sides overwrite it in place (the handle opens without O_TRUNC; "
        "fio finds the file at full size and does not lay it out, --fallocate=none). A fallocated, "
        "never-written file would read back zeros without disk I/O and make each first write convert "
        "extents. "
        + (f"The file's size or allocation CHANGED under {len(changed)} case(s): "
           + ", ".join(f"{c.group} {c.name} {c.op}" for c in changed[:5]) if changed
           else "Checked after every case: size and allocated blocks unchanged."),
        "One file for every job: fio --filename with --numjobs=N --size=S/N --offset_increment=S/N, the "
        "contiguous slices the handle's N threads (intra_op_parallelism=N) cut; block size = fio --bs; queue "
        "depth per thread = fio --iodepth per job; O_DIRECT both (fio --direct=1); page cache dropped "
        "(fdatasync + POSIX_FADV_DONTNEED) before every read of either. fio's io_uring runs with "
        "--fixedbufs: its buffers are faulted in during its set-up, as the handle's tensors are before "
        "they are timed (without it fio's reads pay a page fault per 4 KiB inside its clock whenever a job's "
        "share is not much larger than bs x iodepth; fio's libaio has no such option).",
        "The same memory: deepnvme's locked tensors are 2 MiB-aligned transparent huge pages; fio runs "
        "with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 so its malloc'd buffers are transparent huge pages too "
        "(its own --iomem=shmhuge/mmaphuge need reserved hugetlbfs pages). With 4 KiB pages a 1 MiB request "
        "spans 256 segments, more than this virtio disk takes per request (254), and fio ran at about half "
        "the handle's speed for that alone.",
        "Timing: deepnvme rows are one sync_pwrite / sync_pread of the whole tensor, file open and thread "
        "hand-off included, no fsync; fio rows run from fio's first request issued to its last completed "
        "(never less than fio's own figure), which leaves out its file open, process start and set-up. "
        "CPU-s/GiB: deepnvme, this process's user+system time over the call; fio, the user+system time fio "
        "reports for its jobs (the rusage of fio and its jobs, start-up included, is 'fio rusage' and "
        "cpu_rusage in the JSON). fio reports runtime in whole milliseconds, a few percent of a 64 MiB "
        "transfer.",
        f"Interleaving: the contenders of one grid point run back to back, order rotating each repeat; the "
        f"points run in an order reversed each repeat; {args.rest:g} s of rest before each case, scaled by "
        "its bytes / 1 GiB (--rest).",
        f"Same-settings deepnvme(locked)/fio ratios beyond {MISMATCH:g}× either way are printed as warnings.",
        f"Engines: deepnvme {', '.join(engines)} beside fio's "
        f"{', '.join(e_fio(e) for e in engines)}; available here: {', '.join(available)}.",
    ]
    if "deepspeed" in args.sections:
        notes.append(f"DeepSpeed rows at {format_size(args.ds_size)} only, via {args.deepspeed_python}: "
                     "locked at the two-thread points, plain at QD128 x2 (a child process of their own, same "
                     "file).")
    notes += [
        "Measuring took " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        + f"; {time.time() - t_start:.0f} s in all with set-up.",
    ]
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.release()}", "dir": args.dir,
            "fs": mount_of(args.dir)[1] or "?", "sizes": [format_size(s) for s in args.size_list],
            "repeats": repeats, "read_mode": DESCRIPTIONS[read_mode(args.dir)], "notes": notes,
            "seconds": seconds, "torch": torch.__version__, "engines": engines,
            "argv": sys.argv[1:]}
    write_outputs(cases, analyses, meta, Path(args.out))
    return 0


def round_trip_ok(aio: AioModule, run: SizeRun, engine: str) -> bool:
    """Correctness once, before timing: the locked tensor written, read back into the plain one (a copy of
    it, so no third buffer of the size is needed) and compared."""
    import torch

    h = aio.aio_handle(**handle_settings(engine, 32, 2))
    h.sync_pwrite(run.locked, run.path)
    run.plain.zero_()
    h.sync_pread(run.plain, run.path)
    drop_file_cache(run.path)
    return bool(torch.equal(run.plain, run.locked))


def write_outputs(cases: list[Case], analyses: list[dict], meta: dict, out: Path) -> None:
    """Print the Markdown report and write it, with every sample as JSON, beside --out."""
    report = render(cases, analyses, meta)
    print(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "sizes": analyses,
         "cases": [{"group": c.group, "name": c.name, "op": c.op, "bytes": c.nbytes, "size": c.size,
                    "setting": c.setting.label() if c.setting else None, "kind": c.kind,
                    "layout_changes": c.layout_changes, "samples": c.samples,
                    "summary": summary(c) if c.samples else None} for c in cases]}, indent=1))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
