#!/usr/bin/env python3
"""The offloaded optimizer's step against its bounds and against DeepSpeed's NVMe optimizer offload.

    python3 bench/offload_bench.py [--dir /work/benchtmp] [--sizes 1G,4G] [--budget 256M] [--repeats 3]
                                   [--optimizer adam-fused] [--deepspeed_python /work/dsvenv/bin/python]
                                   [--quick] [--out PREFIX]

For each size (bytes of Adam state: exp_avg + exp_avg_sq, fp32; the model is a stack of square Linear
layers with that much state), one Adam step of:
- memory:  torch.optim.Adam with its state in memory (the compute bound);
- raw:     the aio handle reading all the bytes the offloaded step moves (the state) as one batch, then
           writing them as one batch, at the best handle settings of a small grid tried first (block size,
           threads): the I/O bound of one drive. A batch is every RAW_BUFFER-sized part of the file queued
           at once and waited for once, all through one locked buffer (the bytes are thrown away), so the
           drive never idles between parts and the bound costs no host memory of the state's size;
- offload: deepnvme.offload.OffloadedOptimizer(Adam) with --budget of locked memory;
- deepspeed: DeepSpeed 0.19.8 ZeRO-3, offload_optimizer nvme, pipeline_read/write, default aio and
           buffer_count, world size 1, DS_ACCELERATOR=cpu, in its own venv and process
           (bench/offload_deepspeed_side.py); its engine's optimizer.step alone is timed.
Adam is torch's fused CPU kernel by default (--optimizer): DeepSpeed steps with its own vectorised CPU
Adam, so this is like against like; memory and offload always wrap the same one.
The contenders run back to back in an order that rotates every repeat; cells are medians. Reported per
contender: seconds per step, CPU seconds per step (this process's user+system; DeepSpeed's its own), GB
moved per step (DeepSpeed's: its step reads all its swap files, fp32 master, both moments and the
gradients its backward swapped out, and writes back all but the gradients), requests per step, locked
memory; the ratios the issue sets targets for: offload / max(memory, raw) and DeepSpeed / offload; and the
offloaded step's pipeline (its last_step profile): how long it waited for reads, and how much of the step
the drive was busy reading or writing. Writes Markdown to stdout and <out>.md, every sample (and the
request and update spans of one offloaded step per size) to <out>.json.

Fairness: every contender's file I/O is O_DIRECT (DeepSpeed's aio opens its swap files with O_DIRECT), so
the page cache plays no part for any of them; a host-side cache under a virtual disk is out of reach, and
the rotating order spreads its effect over the contenders. Before each contender the bench syncs (not
timed): a virtual disk's host may still be writing back what the previous contender wrote, and in a fixed
rotation the same contender would always follow it and pay for it. OMP_WAIT_POLICY is set to passive (unless
given) before torch loads, for this process and DeepSpeed's: with libgomp's default, torch's OpenMP
workers spin after each parallel region, and on a small or shared machine that spinning takes the cores
from whichever thread is doing real work (the I/O threads, another contender's process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads libgomp (see the docstring)

import torch  # noqa: E402

# _harness first: it puts this checkout on sys.path before deepnvme is imported
from _harness import ROOT, timed  # noqa: E402
from torch import nn  # noqa: E402

from deepnvme.offload import OffloadedOptimizer  # noqa: E402
from deepnvme.offload._doors import locked_bytes, new_handle  # noqa: E402
from deepnvme.offload.train import StepProfile  # noqa: E402

MIB = 1 << 20
GB = 1e9
# torch.optim.Adam keyword arguments of each --optimizer choice.
OPTIMIZERS = {"adam-fused": {"fused": True}, "adam-foreach": {"foreach": True}, "adam": {"foreach": False}}
# Handle settings the raw bound tries (over the project's recommended ones); the best one is timed.
RAW_GRID = ({}, {"block_size": 4 * MIB}, {"intra_op_parallelism": 4}, {"block_size": 4 * MIB,
                                                                       "intra_op_parallelism": 4})
RAW_BUFFER = 256 * MIB


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MIB, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def shape_for(state_bytes: int, width: int = 0) -> tuple[int, int]:
    """(width, layers) of a Linear stack whose Adam state (8 bytes per parameter) is about `state_bytes`;
    the width by size unless given."""
    width = width or (2048 if state_bytes >= 1 << 30 else 1024 if state_bytes >= 64 * MIB else 256)
    layers = max(1, round(state_bytes / (8 * (width * width + width))))
    return width, layers


def build(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def fake_grads(model: nn.Module) -> None:
    """Gradients without a backward pass: only the optimizer step is timed, and each step sees the same."""
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_(generator=gen)


def load_average() -> str:
    """The 1/5/15-minute load averages: the machine may be shared, and the report says how busy it was."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def deepspeed_moved(path: Path) -> int:
    """Bytes DeepSpeed's optimizer step moves: reads of every swap file, writes of all but gradients'."""
    files = [f for f in path.rglob("*.swp") if f.is_file()]
    return sum(f.stat().st_size * (1 if "_gradient_" in f.name else 2) for f in files)


class RawIO:
    """The handle reading `nbytes` of a file as one batch, then writing them back as one batch: the same
    bytes as the offloaded step, in one transfer each way (see the module docstring), at the best settings
    of RAW_GRID (each tried once, before the timed repeats)."""

    def __init__(self, path: str, nbytes: int, log: Callable[[str], None]) -> None:
        self.nbytes = nbytes
        self.handle = new_handle()
        empty = torch.empty(0, dtype=torch.uint8)
        self.buf = self.handle.new_cpu_locked_tensor(min(nbytes, RAW_BUFFER), empty)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.buf.fill_(7)
        self._batch(write=True)
        tried = []
        for settings in RAW_GRID:
            self.handle = new_handle(**settings)
            tried.append((timed(self.step)[0], settings))
        best_s, self.settings = min(tried, key=lambda t: t[0])
        self.handle = new_handle(**self.settings)
        log("  raw settings tried: " + ", ".join(f"{s or 'recommended'} {t:.3f} s" for t, s in tried))

    def _batch(self, write: bool) -> None:
        submit = self.handle.async_pwrite if write else self.handle.async_pread
        for off in range(0, self.nbytes, self.buf.numel()):
            submit(self.buf[:min(self.buf.numel(), self.nbytes - off)], self.fd, off)
        self.handle.wait()

    def step(self) -> None:
        self._batch(write=False)
        self._batch(write=True)

    def close(self) -> None:
        os.close(self.fd)
        self.handle.free_cpu_locked_tensor(self.buf)


def pipeline(profile: StepProfile) -> dict:
    """What one offloaded step's profile says: requests, the time it waited for reads, the fill (until
    the first tile's update began: its read, with nothing to overlap) and the drain (after the last
    update: its write-back), and the share of the step during which the drive was reading, writing,
    either, and the optimizer updating."""
    wall = profile.ended - profile.began

    def busy(spans: list[tuple[float, float, int]]) -> float:
        total, end = 0.0, float("-inf")
        for a, b, _ in sorted(spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total / wall

    return {"s": wall, "read_requests": len(profile.reads), "write_requests": len(profile.writes),
            "bytes_written": profile.bytes_written,
            "tiles": len(profile.updates), "read_wait_s": profile.read_wait_s,
            "fill_s": profile.updates[0][0] - profile.began if profile.updates else wall,
            "drain_s": profile.ended - profile.updates[-1][1] if profile.updates else 0.0,
            "reading": busy(profile.reads), "writing": busy(profile.writes),
            "io": busy(profile.reads + profile.writes), "updating": busy(profile.updates)}


class DeepSpeedSide:
    """DeepSpeed's step in its own interpreter: one line "STEP" in, "<s> <cpu s> <locked>" out."""

    def __init__(self, python: str, width: int, layers: int, nvme: str) -> None:
        self.error: str | None = None
        cmd = [python, str(ROOT / "bench" / "offload_deepspeed_side.py"), "--width", str(width), "--layers",
               str(layers), "--nvme", nvme]
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        env.pop("PYTHONPATH", None)  # DeepSpeed's venv has its own torch; this tree is not needed there
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        except OSError as exc:
            self.proc, self.error = None, f"cannot start {python}: {exc}"
            return
        first = self._line()
        if first != "READY":
            self.error = first.removeprefix("UNAVAILABLE ") or f"exited with {self.proc.wait()}"
            self.close()

    def _line(self) -> str:
        """The child's next stdout line that is not DeepSpeed's own chatter."""
        while self.proc and self.proc.stdout:
            line = self.proc.stdout.readline()
            if not line:
                return ""
            line = line.strip()
            if line == "READY" or line.startswith(("UNAVAILABLE", "ERROR")) or line[:1].isdigit():
                return line
        return ""

    def step(self) -> tuple[float, float, int] | None:
        if self.proc is None or self.proc.stdin is None:
            return None
        self.proc.stdin.write("STEP\n")
        line = self._line()
        if not line or not line[:1].isdigit():
            self.error = line or "its process ended"
            self.close()
            return None
        s, cpu, locked = line.split()
        return float(s), float(cpu), int(locked)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin:
                self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def run_size(args: argparse.Namespace, size: int, work: Path, log: Callable[[str], None]) -> dict:
    width, layers = shape_for(size, args.width)
    budget = args.budget
    log(f"size {size / GB:.2f} GB of Adam state: {layers} x Linear({width}, {width}), "
        f"budget {budget / MIB:.0f} MiB")
    mem_model, off_model = build(width, layers), build(width, layers)
    fake_grads(mem_model)
    for p, q in zip(off_model.parameters(), mem_model.parameters()):
        p.grad = q.grad  # the same gradients, held once (Adam only reads them)
    kind = OPTIMIZERS[args.optimizer]
    mem_opt = torch.optim.Adam(mem_model.parameters(), lr=1e-4, **kind)
    locked_before = locked_bytes()
    off_opt = OffloadedOptimizer(torch.optim.Adam(off_model.parameters(), lr=1e-4, **kind), work / "offload",
                                 budget)
    off_locked = locked_bytes() - locked_before
    mem_opt.step()  # state made outside the clock, as for every contender
    off_opt.step()
    state = off_opt.swap.reserved_bytes
    raw = RawIO(str(work / "raw.bin"), state, log)
    ds, ds_swapped, ds_skipped = None, None, None
    if args.deepspeed_python and size > args.deepspeed_up_to:
        log("  DeepSpeed not run: above --deepspeed_up_to")
        ds_skipped = f"not run above {args.deepspeed_up_to / GB:.2f} GB (host memory)"
    elif args.deepspeed_python:
        (work / "ds").mkdir(exist_ok=True)
        ds = DeepSpeedSide(args.deepspeed_python, width, layers, str(work / "ds"))
        if ds.error:
            log(f"  DeepSpeed unavailable: {ds.error}")
        else:
            ds_swapped = deepspeed_moved(work / "ds")
    load_before = load_average()
    profiles: list[StepProfile] = []

    def offload_step() -> tuple[float, float, int]:
        got = (*timed(off_opt.step), off_locked)
        if off_opt.last_step is not None:
            profiles.append(off_opt.last_step)
        return got

    contenders: dict[str, Callable[[], tuple[float, float, int] | None]] = {
        "memory": lambda: (*timed(mem_opt.step), 0),
        "raw": lambda: (*timed(raw.step), raw.buf.numel()),
        "offload": offload_step,
    }
    if ds is not None and not ds.error:
        contenders["deepspeed"] = ds.step
    samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            os.sync()  # untimed: what the last contender wrote is on the disk before the next one starts
            got = contenders[name]()
            if got is not None:
                samples[name].append(got)
                log(f"  repeat {r} {name:9s} {got[0]:.3f} s")
            elif name == "deepspeed" and ds is not None and ds.error:
                log(f"  DeepSpeed stopped: {ds.error} (out of host memory? see dmesg)")
                names.remove(name)
    if ds is not None:
        ds.close()
    # Both took the same steps on the same gradients: a step that moved other bytes would not count.
    if len(samples["memory"]) == len(samples["offload"]) and not all(
            torch.equal(a, b) for a, b in zip(mem_model.parameters(), off_model.parameters())):
        raise RuntimeError("the offloaded optimizer's parameters differ from the in-memory one's")
    off_opt.close()
    raw_requests = 2 * -(-state // raw.buf.numel())
    raw.close()
    moved = {"memory": 0, "raw": 2 * state, "offload": 2 * state, "deepspeed": ds_swapped}
    pipes = [pipeline(p) for p in profiles]
    median_pipe = sorted(pipes, key=lambda p: p["s"])[len(pipes) // 2] if pipes else None
    requests = {"memory": 0, "raw": raw_requests, "deepspeed": None,
                "offload": median_pipe and median_pipe["read_requests"] + median_pipe["write_requests"]}
    cells = {}
    for name, got in samples.items():
        if not got:
            continue
        cells[name] = {"s": statistics.median(g[0] for g in got),
                       "cpu_s": statistics.median(g[1] for g in got),
                       "locked": max(g[2] for g in got), "bytes_moved": moved[name],
                       "requests": requests[name], "samples": got}
    bound = max(cells["memory"]["s"], cells["raw"]["s"])
    spans = None
    if median_pipe is not None:  # the median step's spans, from its start, for a timeline
        prof = profiles[pipes.index(median_pipe)]
        spans = {k: [(a - prof.began, b - prof.began, n) for a, b, n in getattr(prof, k)]
                 for k in ("reads", "updates", "writes")}
    out = {"size": size, "width": width, "layers": layers, "state_bytes": state, "budget": budget,
           "load_before": load_before, "load_after": load_average(), "raw_settings": raw.settings,
           "cells": cells, "offload_vs_bound": cells["offload"]["s"] / bound,
           "pipeline": median_pipe, "pipeline_samples": pipes, "spans": spans}
    if "deepspeed" in cells:
        out["deepspeed_vs_offload"] = cells["deepspeed"]["s"] / cells["offload"]["s"]
        out["locked_vs_deepspeed"] = off_locked / max(1, cells["deepspeed"]["locked"])
    elif ds is not None:
        out["deepspeed_error"] = ds.error
    elif ds_skipped:
        out["deepspeed_error"] = ds_skipped
    return out


def render(results: list[dict], meta: dict) -> str:
    quick = ", --quick" if meta["quick"] else ""
    lines = [f"# Offloaded optimizer step ({meta['when']}, {meta['host']}{quick})",
             "", f"{meta['optimizer']}, fp32; {meta['repeats']} interleaved repeats, medians; "
             f"OMP_WAIT_POLICY={meta['omp_wait_policy']}. {meta['note']}",
             "", "Load average (1/5/15 min) " + "; ".join(
                 f"{r['state_bytes'] / GB:.2f} GB: {r['load_before']} before, {r['load_after']} after"
                 for r in results) + ".", "",
             "| state | budget | contender | s/step | CPU-s/step | GB moved/step | requests/step "
             "| locked MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, c in r["cells"].items():
            moved = "" if c["bytes_moved"] is None else f"{c['bytes_moved'] / GB:.2f}"
            reqs = "" if c.get("requests") is None else str(c["requests"])
            lines.append(f"| {r['state_bytes'] / GB:.2f} GB | {r['budget'] / MIB:.0f} MiB | {name} | "
                         f"{c['s']:.3f} | "
                         f"{c['cpu_s']:.3f} | {moved} | {reqs} | {c['locked'] / MIB:.0f} |")
    lines += ["", "| state | offload / max(memory, raw) | DeepSpeed / offload | locked: offload / DS |",
              "|---|---|---|---|"]
    for r in results:
        ds = (f"{r['deepspeed_vs_offload']:.2f}" if "deepspeed_vs_offload" in r
              else r.get("deepspeed_error", "-"))
        lk = f"{r['locked_vs_deepspeed']:.2f}" if "locked_vs_deepspeed" in r else "-"
        lines.append(f"| {r['state_bytes'] / GB:.2f} GB | {r['offload_vs_bound']:.2f} | {ds} | {lk} |")
    lines += ["", "Raw settings chosen: " + "; ".join(
        f"{r['state_bytes'] / GB:.2f} GB: {r['raw_settings'] or 'recommended'}" for r in results) + ".",
              "", "The offloaded step's pipeline (its median repeat; shares of the step's time):", "",
              "| state | tiles | read / write requests | GB written (drive wear) | waited for reads | "
              "fill / drain | drive reading | writing | either | updating |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p = r.get("pipeline")
        if p:
            lines.append(f"| {r['state_bytes'] / GB:.2f} GB | {p['tiles']} | {p['read_requests']} / "
                         f"{p['write_requests']} | {p.get('bytes_written', 0) / GB:.2f} | "
                         f"{p['read_wait_s']:.3f} s | {p['fill_s'] * 1e3:.0f} / "
                         f"{p['drain_s'] * 1e3:.0f} ms | {p['reading']:.0%} | "
                         f"{p['writing']:.0%} | {p['io']:.0%} | {p['updating']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where the swap files go (default: a temporary directory)")
    ap.add_argument("--sizes", default="1G,4G", help="bytes of Adam state per model, comma-separated")
    ap.add_argument("--budget", default="256M", help="locked memory of the offloaded optimizer")
    ap.add_argument("--optimizer", default="adam-fused", choices=sorted(OPTIMIZERS),
                    help="torch's Adam kernel, the same for the in-memory and the offloaded step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--width", type=int, default=0,
                    help="width of the square layers (default: by size); one whose state is over a tile (a "
                         "quarter of the budget) is stepped in chunks, e.g. 8192 with the default budget")
    ap.add_argument("--deepspeed_python", default="", help="an interpreter that imports deepspeed 0.19.8")
    ap.add_argument("--deepspeed_up_to", default="1T",
                    help="largest size DeepSpeed runs at (its process needs ~5x the state in memory)")
    ap.add_argument("--quick", action="store_true", help="one small size, 2 repeats: shows the bench works")
    ap.add_argument("--note", default="", help="a line for the report (e.g. 'machine busy')")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "offload"))
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.budget, args.repeats = "64M", "16M", 2
    args.budget = parse_size(args.budget)
    args.deepspeed_up_to = parse_size(args.deepspeed_up_to)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="offload-bench-", dir=args.dir))
    (work / "offload").mkdir()

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "quick": args.quick, "repeats": args.repeats, "note": args.note, "torch": torch.__version__,
            "optimizer": args.optimizer, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
            "torch_threads": torch.get_num_threads()}
    results: list[dict] = []
    try:
        for size in sizes:  # the report is rewritten after each size: a later size that fails keeps it
            results.append(run_size(args, size, work, log))
            text = render(results, meta)
            Path(args.out + ".md").write_text(text)
            Path(args.out + ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
