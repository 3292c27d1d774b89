#!/usr/bin/env python3
"""Training a Llama-like model with its parameters, gradients and AdamW state on the drive
(deepnvme.offload's offload_parameters + OffloadedOptimizer) against the same training in memory, the
drive's bound, and DeepSpeed ZeRO-3 with parameters and optimizer offloaded to NVMe.

    python3 bench/train_offload_bench.py [--size 1.5g|medium|small] [--small] [--hidden H --layers L ...]
                                         [--batch 1] [--seq 256] [--warmup 2] [--steps 3] [--repeats 3]
                                         [--budget B] [--opt_budget B] [--cgroup-mb N] [--step_in_backward]
                                         [--checkpointing] [--offload_embeddings]
                                         [--deepspeed_python /work/dsvenv/bin/python] [--world N] [--dir DIR]
                                         [--out PREFIX]

The model is transformers' LlamaForCausalLM made from a LlamaConfig here (nothing downloaded), fp32, weights
of seed 0; `--size` picks its shape (default 1.5g: 374 M parameters, 1.50 GB; `--small`: 40 M, 162 MB, for a
run of a few minutes), and --hidden/--intermediate/--layers/--heads/--vocab override any of it. One training
step is forward + backward (labels = inputs) + AdamW(lr 1e-4) + zero_grad, on `--batch` x `--seq` tokens
(the same batches, seeded by step, for every contender); `--checkpointing` turns on activation
checkpointing of every block in every contender. Contenders:
- memory:    the same training in memory (torch.optim.AdamW);
- io-bound:  the bytes one offloaded step moves (its own counters: off.stats() deltas + opt.last_step of a
             timed step) over the drive's raw speeds, measured here in the same run: deepnvme's aio handle
             reading, then writing, one file of that size as one batch through one locked buffer, at the
             best handle settings of offload_bench.py's grid (read and write each choose their own), the
             way offload_bench.py measures "raw". Its s/step is max(memory's s/step, read + write time);
- offload:   offload_parameters (each decoder block a unit; embeddings, head and final norm stay in memory)
             + OffloadedOptimizer(AdamW), --budget and --opt_budget of locked memory (default by size:
             64M each for small, 128M medium, 256M 1.5g); the model is built
             without weights (accelerate's init_empty_weights) and filled from deepnvme's store written once
             beforehand (--offload_build memory: built in memory, then offloaded); run inside a memory
             cgroup limited to --cgroup-mb when given; --step_in_backward: each block stepped in its
             backward (its gradients never written, and the I/O bound is of the bytes that moves);
             --offload_embeddings: the embeddings and the head are units too (else they stay in memory);
- deepspeed: DeepSpeed 0.19.8 ZeRO-3, offload_param and offload_optimizer to NVMe (pipeline_read/write),
             torch.optim.AdamW as client optimizer (zero_force_ds_cpu_optimizer false), default aio
             settings, one process, gloo, DS_ACCELERATOR=cpu, run by --deepspeed_python (its own venv).
             Three settings differ from DeepSpeed's defaults, each because the default would not keep the
             parameters on the drive: offload_param max_in_cpu 0 (default 1e9 elements: at initialize it
             copies that many parameter elements "permanently to CPU", so a model under 1e9 parameters
             never reads one from the drive); stage3_max_live_parameters 2 blocks, max_reuse_distance 0,
             prefetch_bucket_size 1 block (the defaults, 1e9, keep every fetched parameter live, and
             with max_in_cpu 0 the swap buffers run out: "Not enough buffers 0 for swapping 1");
             buffer_count 16 of buffer_size = the largest parameter (the embedding; one parameter per
             buffer). The model is converted with zero.Init(module=model, config) before initialize: a
             model converted inside initialize() is made bf16 on the CPU accelerator (see the child).
Several ranks (--world N, issue 37): memory is FSDP2 in memory (fully_shard on the embeddings, each block
and the head, then the model), offload is FSDP2 with offload_shards + OffloadedOptimizer (the model built on
the meta device, each rank's shards made from the store, each rank its folder), deepspeed runs on N ranks;
each rank is a process in a cgroup of its own, batches seeded by (rank, step); a step takes its slowest
rank's seconds, other figures are per rank, and io-bound is of all ranks' bytes on the one drive.
Each contender (but io-bound, measured in this process) runs in a process of its own
(bench/train_offload_child.py), in a memory cgroup v1 of its own made under this process's cgroup and
removed after (limited for offload with --cgroup-mb, else unlimited: its peak is recorded either way), one
process at a time: --warmup steps untimed, then --steps timed ones. Each repeat runs every contender once,
in an order that rotates by one every repeat; cells are medians over every timed step of every repeat.

Reported per contender: s/step, tokens/s, CPU-seconds per step (the process's user+system, all threads),
peak RSS (VmHWM over the whole process: building, loading, warm-up, timed steps; and over the timed steps
alone), the cgroup's peak (page cache included), locked memory (VmLck; offload's budgets), GB read and
written per step (/proc/<pid>/io of the process: every contender's drive traffic, O_DIRECT included; for
offload also its own counters); the ratios offload / max(memory, I/O bound) and DeepSpeed / offload; and
the last step's loss of each (memory and offload must agree bit for bit; the bench says if not).
Fairness: all file I/O is O_DIRECT (deepnvme's and DeepSpeed's), so the page cache plays no part; the bench
syncs before each contender (untimed). OMP_WAIT_POLICY is passive unless given (see offload_bench.py).
Writes Markdown to stdout and <out>.md, everything (every step's sample) to <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads libgomp (see the docstring)

import torch  # noqa: E402

# _harness first: it puts this checkout on sys.path before deepnvme is imported
from _harness import ROOT, interleave  # noqa: E402
from offload_bench import RAW_BUFFER, RAW_GRID  # noqa: E402
from stream_bench import CGROUP_V1, MemoryCgroup, load_average  # noqa: E402
from train_offload_child import SIZES  # noqa: E402

from deepnvme.offload._doors import new_handle  # noqa: E402
from deepnvme.tools.sizes import parse_size  # noqa: E402

MIB = 1 << 20
GB = 1e9
CHILD = ROOT / "bench" / "train_offload_child.py"
#: the order of the first repeat; offload first, so that io-bound always knows the bytes of a step
CONTENDERS = ("offload", "io-bound", "memory", "deepspeed")
#: default budgets (each of offload_parameters' and OffloadedOptimizer's) by --size
BUDGETS = {"small": "64M", "medium": "128M", "1.5g": "256M"}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ drive bound
class DriveSpeed:
    """The raw handle reading, then writing, `nbytes` of one file, each as one batch through one locked
    buffer of RAW_BUFFER bytes (offload_bench.py's RawIO, timed a direction at a time). The first
    measure() tries every RAW_GRID setting for each direction and keeps the fastest of each."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.handle = new_handle()
        empty = torch.empty(0, dtype=torch.uint8)
        self.buf = self.handle.new_cpu_locked_tensor(min(nbytes, RAW_BUFFER), empty)
        self.buf.fill_(7)
        self._batch(self.handle, nbytes, write=True)  # the file's blocks allocated and written once
        self.best: dict[str, dict] = {}
        self.tried: dict[str, list] = {}

    def _batch(self, handle: Any, nbytes: int, write: bool) -> float:
        submit = handle.async_pwrite if write else handle.async_pread
        t = time.perf_counter()
        for off in range(0, nbytes, self.buf.numel()):
            submit(self.buf[:min(self.buf.numel(), nbytes - off)], self.fd, off)
        handle.wait()
        return time.perf_counter() - t

    def measure(self, read: int, written: int) -> dict[str, Any]:
        """Seconds to read `read` and to write `written` bytes at the best settings (chosen on first use)."""
        out: dict[str, Any] = {}
        for direction, nbytes in (("read", read), ("write", written)):
            nbytes = min(nbytes, self.nbytes)
            if direction not in self.best:
                tried = []
                for settings in RAW_GRID:
                    os.sync()
                    s = self._batch(new_handle(**settings), nbytes, direction == "write")
                    tried.append((s, settings))
                self.tried[direction] = [(s, t) for t, s in tried]
                self.best[direction] = min(tried, key=lambda t: t[0])[1]
                log(f"    raw {direction} settings tried: "
                    + ", ".join(f"{s or 'recommended'} {nbytes / t / GB:.2f} GB/s" for t, s in tried))
            os.sync()
            s = self._batch(new_handle(**self.best[direction]), nbytes, direction == "write")
            out[f"{direction}_s"], out[f"{direction}_bytes"] = s, nbytes
            out[f"{direction}_gbps"] = nbytes / s / GB
        return out

    def close(self) -> None:
        os.close(self.fd)
        self.handle.free_cpu_locked_tensor(self.buf)
        self.path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ children
def own_cgroup() -> Path:
    """This process's memory cgroup v1 directory (children's cgroups are made under it)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1 / path.lstrip("/")
    return CGROUP_V1


def run_child(args: argparse.Namespace, spec: dict[str, Any], python: str, limit: int | None) -> dict:
    """One contender's processes (spec["world"] ranks, each in a cgroup of its own when --no_cgroup is
    not given); its RESULT, plus the cgroup's figures, or {"error": ...}; several ranks' merged (merge)."""
    world = spec.get("world", 1)
    env = {**os.environ}
    if spec["contender"] == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("PYTHONPATH", None)  # DeepSpeed's venv has its own packages
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    outs: list[dict[str, Any]] = [{"limit": limit} for _ in range(world)]
    groups: list[MemoryCgroup | None] = [None] * world
    procs: list[subprocess.Popen | None] = [None] * world
    os.sync()  # untimed: what the last contender wrote is on the disk before this one starts
    try:
        for r in range(world):
            argv = [python, str(CHILD), json.dumps(spec)]
            if args.cgroup:
                name = f"train-offload-bench-{os.getpid()}-{spec['contender']}-{r}"
                groups[r] = MemoryCgroup(str((own_cgroup() / name).relative_to(CGROUP_V1)), limit)
                argv = groups[r].wrap(argv)  # type: ignore[union-attr]
            procs[r] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r, proc in enumerate(procs):
            _collect(args, spec, proc, outs[r])  # type: ignore[arg-type]
    except OSError as exc:
        outs[0]["error"] = f"cannot start {python}: {exc}"
    finally:
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for group, out in zip(groups, outs):
            if group is not None:
                group.close_into(out)
    return outs[0] if world == 1 else merge(outs)


def _collect(args: argparse.Namespace, spec: dict[str, Any], proc: subprocess.Popen, out: dict) -> None:
    """Wait for one rank's process; its RESULT into `out`, or out["error"]."""
    try:
        stdout, stderr = proc.communicate(timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        out["error"] = f"did not finish within --child_timeout {args.child_timeout:g} s"
        return
    lines = stdout.splitlines()
    result = next((x[7:] for x in lines[::-1] if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or result is None:
        err = next((x[6:] for x in lines[::-1] if x.startswith("ERROR ")), None)
        last = err or (stderr.strip().splitlines() or ["(no output)"])[-1]
        out["error"] = f"exit {proc.returncode}: {last}"
        log(f"    {spec['contender']} failed: {out['error']}\n" + stderr[-3000:] + stdout[-3000:])
    else:
        out.update(json.loads(result))


def free_port() -> int:
    """A TCP port free now on the loopback (for the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def merge(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ranks' results as one: a step takes its slowest rank's seconds; CPU seconds and bytes are
    per rank (means); peaks and locked memory the largest rank's; losses rank 0's."""
    errors = [f"rank {r}: {o['error']}" for r, o in enumerate(outs) if "error" in o]
    if errors:
        return {"error": "; ".join(errors), "limit": outs[0].get("limit")}
    first = outs[0]
    steps = []
    for at in zip(*(o["steps"] for o in outs)):
        step = {"s": max(x["s"] for x in at), "fb_s": max(x["fb_s"] for x in at)}
        for key in at[0]:
            if key not in step and all(isinstance(x.get(key), (int, float)) for x in at):
                step[key] = statistics.mean(x[key] for x in at)
            elif key not in step:
                step[key] = at[0][key]
        steps.append(step)
    out = {**first, "steps": steps, "ranks": len(outs), "per_rank": outs}
    for key in ("peak_rss", "step_peak_rss", "setup_peak_rss", "locked", "import_rss", "cgroup_peak"):
        if all(key in o for o in outs):
            out[key] = max(o[key] for o in outs)
    out["setup_s"] = max(o["setup_s"] for o in outs)
    return out


# ------------------------------------------------------------------------------------------ report
def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(name: str, samples: list[dict], tokens: int) -> dict[str, Any]:
    """Medians over every timed step of every repeat of one contender, and its extremes."""
    ok = [s for s in samples if "error" not in s]
    if name == "io-bound":
        io = [s["read_s"] + s["write_s"] for s in ok]
        return {"io_s": med(io), "read_gbps": med([s["read_gbps"] for s in ok]),
                "write_gbps": med([s["write_gbps"] for s in ok]),
                "read_bytes": med([s["read_bytes"] for s in ok]),
                "written_bytes": med([s["write_bytes"] for s in ok]),
                "runs": len(ok), "errors": [s["error"] for s in samples if "error" in s]}
    steps = [st for s in ok for st in s["steps"]]
    cell: dict[str, Any] = {"runs": len(ok), "errors": [s["error"] for s in samples if "error" in s]}
    if not steps:
        return cell
    s_step = statistics.median(st["s"] for st in steps)
    cell.update({
        "s": s_step, "s_min": min(st["s"] for st in steps), "s_max": max(st["s"] for st in steps),
        "tokens_per_s": tokens / s_step, "cpu_s": statistics.median(st["cpu_s"] for st in steps),
        "fb_s": statistics.median(st["fb_s"] for st in steps),
        "opt_s": statistics.median(st["s"] - st["fb_s"] for st in steps),
        "import_rss": max(s["import_rss"] for s in ok),
        "io_read": statistics.median(st["io_read"] for st in steps),
        "io_written": statistics.median(st["io_written"] for st in steps),
        "peak_rss": max(s["peak_rss"] for s in ok), "step_peak_rss": max(s["step_peak_rss"] for s in ok),
        "cgroup_peak": max((s.get("cgroup_peak", 0) for s in ok), default=0),
        "locked": max(s["locked"] for s in ok), "locked_budget": max(s["locked_budget"] for s in ok),
        "setup_s": statistics.median(s["setup_s"] for s in ok), "last_loss": ok[0]["losses"][-1],
        "losses": ok[0]["losses"],
    })
    if any("demanded" in st for st in steps):
        cell["demanded"] = statistics.median(st["demanded"] for st in steps)
        cell["prefetched"] = statistics.median(st["prefetched"] for st in steps)
        cell["opt_read_wait_s"] = statistics.median(st["read_wait_s"] or 0.0 for st in steps)
    if any("fb_read" in st for st in steps):
        cell["fb_read"] = statistics.median(st["fb_read"] for st in steps)
        cell["fb_written"] = statistics.median(st["fb_written"] for st in steps)
    own = [st for st in steps if st.get("own_read") is not None]
    if own:
        cell["own_read"] = statistics.median(st["own_read"] for st in own)
        cell["own_written"] = statistics.median(st["own_written"] for st in own)
    return cell


def render(res: dict[str, Any]) -> str:
    meta, cells = res["meta"], res["cells"]
    m = res["model"]

    def num(v: float | None, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    world = meta.get("world", 1)

    lines = [f"# Training with parameters, gradients and AdamW state on the drive ({meta['when']}, "
             f"{meta['host']})", "", f"`{meta['command']}`", "",
             f"Model: LlamaForCausalLM {m['shape']} ({m['params'] / 1e6:.1f} M parameters, "
             f"{m['param_bytes'] / GB:.3f} GB fp32, {m['block_param_bytes'] / GB:.3f} GB of it in the "
             "decoder blocks" + (f"; {world} ranks (gloo, this machine), FSDP2's fully_shard on the "
                                 "embeddings, each block and the head, then the model; offload: "
                                 "offload_shards + OffloadedOptimizer, each rank its folder; per rank: "
                                 "CPU-s, RSS, cgroup peak, locked memory and GB; s/step: the slowest rank's"
                                 if world > 1 else
                                 "; offload moves all of it" if meta.get("offload_embeddings") else
                                 " that offload moves; the rest stays in memory")
             + "). Step: forward + backward + "
             f"AdamW, batch {meta['batch']} x seq {meta['seq']}{f' x {world} ranks' if world > 1 else ''} = "
             f"{meta['tokens']} tokens"
             f"{', activation checkpointing' if meta.get('checkpointing') else ''}. "
             f"{meta['repeats']} interleaved repeats x {meta['steps']} timed steps after {meta['warmup']} "
             f"warm-up steps, medians; torch {meta['torch']}, {meta['torch_threads']} threads, "
             f"OMP_WAIT_POLICY={meta['omp_wait_policy']}. Offload: budget {meta['budget'] // MIB} MiB "
             f"(parameters) + {meta['opt_budget'] // MIB} MiB (optimizer)"
             f"{', step in backward' if meta.get('step_in_backward') else ''}"
             f"{', embeddings and head offloaded as units' if meta.get('offload_embeddings') else ''}"
             ", build from "
             f"{meta['offload_build']}, cgroup limit "
             f"{str(meta['cgroup_mb']) + ' MiB' if meta['cgroup_mb'] else 'none'}. {meta['note']}", "",
             f"Load average (1/5/15 min): {meta['load_before']} before, {meta['load_after']} after.", "",
             "| contender | s/step (min–max) | fwd+bwd / opt step s | tokens/s | CPU-s/step "
             "| peak RSS MiB (steps) | cgroup peak MiB | locked MiB (budget) | GB read/step "
             "| GB written/step | last loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in CONTENDERS:
        c = cells.get(name)
        if c is None:
            continue
        if name == "io-bound":
            b = res.get("bound")
            if c.get("io_s") is None:
                lines.append(f"| io-bound | failed: {'; '.join(c['errors']) or 'no sample'} ||||||||||")
                continue
            lines.append(f"| io-bound: max(memory, I/O) | {num(b, '.3f')} (I/O {c['io_s']:.3f}: read "
                         f"{c['read_gbps']:.2f} GB/s, write {c['write_gbps']:.2f} GB/s) | | "
                         f"{num(b and meta['tokens'] / b, '.0f')} | | | | {RAW_BUFFER // MIB} | "
                         f"{c['read_bytes'] / GB:.3f} | {c['written_bytes'] / GB:.3f} | |")
            continue
        if "s" not in c:
            reason = "; ".join(c["errors"]) or "not run"
            lines.append(f"| {name} | failed: {reason} ||||||||||")
            continue
        own = (f" (own {c['own_read'] / GB:.3f})" if "own_read" in c else "")
        own_w = (f" (own {c['own_written'] / GB:.3f})" if "own_written" in c else "")
        budget = f" ({c['locked_budget'] / MIB:.0f})" if c["locked_budget"] else ""
        lines.append(f"| {name} | {c['s']:.3f} ({c['s_min']:.3f}–{c['s_max']:.3f}) | "
                     f"{c['fb_s']:.3f} / {c['opt_s']:.3f} | {c['tokens_per_s']:.0f} | "
                     f"{c['cpu_s']:.3f} | {c['peak_rss'] / MIB:.0f} ({c['step_peak_rss'] / MIB:.0f}) | "
                     f"{c['cgroup_peak'] / MIB:.0f} | {c['locked'] / MIB:.0f}{budget} | "
                     f"{c['io_read'] / GB:.3f}{own} | {c['io_written'] / GB:.3f}{own_w} | "
                     f"{c['last_loss']:.6f} |")
    r = res["ratios"]
    ds = (num(r["deepspeed_vs_offload"], ".2f") if "deepspeed_vs_offload" in r
          else r.get("deepspeed_error", "—"))
    lines += ["", "| offload / max(memory, I/O bound) | DeepSpeed / offload | offload / memory |",
              "|---|---|---|", f"| {num(r.get('offload_vs_bound'), '.2f')} | {ds} | "
              f"{num(r.get('offload_vs_memory'), '.2f')} |", ""]
    lines += [f"- Losses: memory and offload {res['checks']['offload_equals_memory']}.",
              f"- Raw handle settings chosen: {res.get('raw_settings', '—')}.",
              "- Setup seconds per process (build/load/offload or DeepSpeed init, untimed): "
              + ", ".join(f"{n} {c['setup_s']:.1f}" for n, c in cells.items() if "setup_s" in c) + ".",
              "- RSS of each process after importing torch and transformers, before any model: "
              + ", ".join(f"{n} {c['import_rss'] / MIB:.0f} MiB" for n, c in cells.items()
                          if "import_rss" in c)
              + ".",
              "- peak RSS: the process's VmHWM over its whole life (build, load, warm-up, steps); in "
              "brackets over the timed steps alone. cgroup peak: the contender's cgroup's "
              "max_usage_in_bytes (page cache included). GB read/written: /proc/<pid>/io of the process; "
              "offload's own counters in brackets.",
              ]
    off = cells.get("offload", {})
    pb = res.get("phase_bound")
    if pb and "s" in off:
        lines.append(f"- Phase by phase (the optimizer step starts after backward): max(memory's fwd+bwd, "
                     f"its I/O {pb['fb_io_s']:.3f} s) + max(memory's opt step, its I/O "
                     f"{pb['opt_io_s']:.3f} s) = {pb['s']:.3f} s; offload / that: {off['s'] / pb['s']:.2f}.")
    if "demanded" in off:
        lines.append(f"- offload per step (medians): {off['prefetched']:.0f} unit reads read ahead, "
                     f"{off['demanded']:.0f} demanded (the pass waited for them); the optimizer step waited "
                     f"{off['opt_read_wait_s']:.3f} s for its reads.")
    lines.append("- fwd+bwd / opt step: the step's seconds until backward() returned, and after (optimizer "
                 "step and zero_grad; DeepSpeed's engine.step).")
    for n, c in cells.items():
        if c.get("errors"):
            lines.append(f"- {n} errors: " + "; ".join(c["errors"]))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1.5g", choices=sorted(SIZES), help="model shape (default 1.5g)")
    ap.add_argument("--small", action="store_true", help="--size small (162 MB): a run of a few minutes")
    for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
        ap.add_argument(f"--{k}", type=int, default=0, help=f"override the size's {k}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps in each process before the timed ones")
    ap.add_argument("--steps", type=int, default=3, help="timed steps in each process")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--budget", default="", help="offload_parameters' locked memory (default: the size's)")
    ap.add_argument("--opt_budget", default="",
                    help="OffloadedOptimizer's locked memory (default: the size's)")
    ap.add_argument("--offload_build", choices=("checkpoint", "memory"), default="checkpoint",
                    help="offload's model: filled from deepnvme's store (never whole in memory), or built "
                         "in memory and then offloaded")
    ap.add_argument("--offload_embeddings", action="store_true",
                    help="offload's units include the embeddings and the head (one unit each; --budget "
                         "must hold the larger with its gradient)")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing of every block (transformers' own, not reentrant) in "
                         "every contender")
    ap.add_argument("--step_in_backward", action="store_true",
                    help="offload's optimizer steps each block in its backward (OffloadedOptimizer("
                         "step_in_backward=True)): its gradients never reach the drive")
    ap.add_argument("--cgroup-mb", "--cgroup_mb", dest="cgroup_mb", type=int, default=0,
                    help="memory cgroup v1 limit of the offload contender's process, MiB (0: no limit)")
    ap.add_argument("--no_cgroup", dest="cgroup", action="store_false",
                    help="run the children without cgroups (no cgroup peak; --cgroup-mb not allowed)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma-separated subset of " + ",".join(CONTENDERS))
    ap.add_argument("--deepspeed_python", default="/work/dsvenv/bin/python",
                    help="an interpreter that imports deepspeed 0.19.8 ('' to skip DeepSpeed)")
    ap.add_argument("--ds_buffer_count", type=int, default=16,
                    help="DeepSpeed's offload_param buffer_count (each buffer holds one parameter)")
    ap.add_argument("--ds_max_in_cpu", type=int, default=0,
                    help="DeepSpeed's offload_param max_in_cpu (its default, 1e9, keeps the parameters of "
                         "any smaller model in memory: none is read from the drive)")
    ap.add_argument("--ds_zero", default="",
                    help="JSON of zero_optimization keys to set (sub_group_size, stage3_max_live_parameters, "
                         "stage3_max_reuse_distance, stage3_prefetch_bucket_size, "
                         "stage3_param_persistence_threshold)")
    ap.add_argument("--ds_aio", default="", help="DeepSpeed's aio section as JSON (default: its defaults)")
    ap.add_argument("--world", type=int, default=1,
                    help="ranks (gloo, this machine): with more than 1, memory is FSDP2 in memory, offload "
                         "is FSDP2 with offload_shards + OffloadedOptimizer (each rank its folder, its "
                         "cgroup of --cgroup-mb), deepspeed runs on as many ranks; figures are per rank, a "
                         "step's seconds its slowest rank's, the I/O bound of all ranks' bytes on the one "
                         "drive")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    ap.add_argument("--child_timeout", type=float, default=3600)
    ap.add_argument("--dir", default=None, help="where swap files go (default: a temporary directory)")
    ap.add_argument("--note", default="", help="a line for the report")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_offload"))
    args = ap.parse_args(argv)
    if args.small:
        args.size = "small"
    if args.cgroup_mb and not args.cgroup:
        ap.error("--cgroup-mb needs cgroups (drop --no_cgroup)")
    if args.cgroup and (why := MemoryCgroup.available()):
        ap.error(f"{why}; --no_cgroup runs without them")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = dict(SIZES[args.size])
    for k in shape:
        if getattr(args, k):
            shape[k] = getattr(args, k)
    budget = parse_size(args.budget or BUDGETS[args.size])
    opt_budget = parse_size(args.opt_budget or BUDGETS[args.size])
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if "io-bound" in wanted and not {"offload", "memory"} <= set(wanted):
        raise SystemExit("io-bound needs offload (its bytes) and memory (its compute) among --contenders")
    if not args.deepspeed_python and "deepspeed" in wanted:
        wanted.remove("deepspeed")
    work = Path(tempfile.mkdtemp(prefix="train-offload-bench-", dir=args.dir))
    meta: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "size": args.size, "batch": args.batch, "seq": args.seq, "world": args.world,
        "tokens": args.world * args.batch * args.seq,
        "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats, "budget": budget,
        "opt_budget": opt_budget, "offload_build": args.offload_build, "cgroup_mb": args.cgroup_mb,
        "step_in_backward": args.step_in_backward, "checkpointing": args.checkpointing,
        "offload_embeddings": args.offload_embeddings, "note": args.note, "torch": torch.__version__,
        "torch_threads": args.threads or torch.get_num_threads(),
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "load_before": load_average(), "dir": str(work)}
    base = {"shape": shape, "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps,
            "lr": args.lr, "threads": args.threads, "root": str(ROOT), "store": str(work / "store"),
            "world": args.world,
            "budget": budget, "opt_budget": opt_budget, "build": args.offload_build,
            "step_in_backward": args.step_in_backward, "checkpointing": args.checkpointing,
            "offload_embeddings": args.offload_embeddings,
            "ds_buffer_count": args.ds_buffer_count, "ds_max_in_cpu": args.ds_max_in_cpu,
            "ds_zero": json.loads(args.ds_zero or "{}"), "ds_aio": json.loads(args.ds_aio or "null")}
    samples: dict[str, list[dict]] = {c: [] for c in wanted}
    drive: DriveSpeed | None = None
    try:
        log(f"model {shape}: writing it (seed 0) to deepnvme's store, untimed")
        prep = run_child(args, {**base, "contender": "prepare", "world": 1}, sys.executable, None)
        if "error" in prep:
            raise RuntimeError(f"could not write the model's store: {prep['error']}")
        model = {"shape": shape, "params": prep["params"], "param_bytes": prep["param_bytes"],
                 "block_param_bytes": prep["block_param_bytes"]}
        log(f"  {prep['params'] / 1e6:.1f} M parameters, {prep['param_bytes'] / GB:.3f} GB")
        if args.offload_build == "memory":
            shutil.rmtree(work / "store")
        for r, _, name in interleave([[c for c in CONTENDERS if c in wanted]], args.repeats):
            if name == "io-bound":
                steps = [st for s in samples["offload"] if "error" not in s for st in s["steps"]]
                if not steps:
                    samples[name].append({"error": "no offloaded step to take the bytes from"})
                    continue
                # Every rank's bytes go to the one drive: the bound is of all of them.
                read = args.world * int(statistics.median(st["own_read"] for st in steps))
                written = args.world * int(statistics.median(st["own_written"] for st in steps))
                if drive is None:
                    drive = DriveSpeed(work / "raw.bin", max(read, written))
                got = drive.measure(read, written)
                samples[name].append(got)
                log(f"  repeat {r} io-bound  read {got['read_s']:.3f} s ({got['read_gbps']:.2f} GB/s) write "
                    f"{got['write_s']:.3f} s ({got['write_gbps']:.2f} GB/s)")
                continue
            spec = {**base, "contender": name, "swap_dir": str(work / f"swap-{name}")}
            python = args.deepspeed_python if name == "deepspeed" else sys.executable
            limit = args.cgroup_mb * MIB if name == "offload" and args.cgroup_mb else None
            got = run_child(args, spec, python, limit)
            shutil.rmtree(work / f"swap-{name}", ignore_errors=True)
            samples[name].append(got)
            if "error" in got:
                log(f"  repeat {r} {name:9s} failed: {got['error']}")
            else:
                log(f"  repeat {r} {name:9s} " + " ".join(f"{st['s']:.3f}" for st in got["steps"])
                    + f" s/step, peak RSS {got['peak_rss'] / MIB:.0f} MiB")
    finally:
        if drive is not None:
            drive.close()
        shutil.rmtree(work, ignore_errors=True)
    meta["load_after"] = load_average()
    res = assemble(meta, model, samples, drive)
    text = render(res)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({**res, "samples": samples}, indent=1))
    print(text)
    return 0


def assemble(meta: dict[str, Any], model: dict[str, Any], samples: dict[str, list[dict]],
             drive: DriveSpeed | None) -> dict[str, Any]:
    """The cells, the bound, the ratios and the checks of a finished run."""
    cells = {n: summarise(n, s, meta["tokens"]) for n, s in samples.items()}
    mem, off, ds, io = (cells.get(k, {}) for k in ("memory", "offload", "deepspeed", "io-bound"))
    res: dict[str, Any] = {"meta": meta, "model": model, "cells": cells, "ratios": {}, "checks": {}}
    if "s" in mem and io.get("io_s") is not None:
        res["bound"] = max(mem["s"], io["io_s"])
    if "s" in mem and io.get("io_s") is not None and "fb_read" in off:
        # The same bound phase by phase: forward+backward, then the optimizer step (which starts only once
        # backward has returned, so its I/O cannot overlap the forward's compute).
        # Every rank's bytes go to the one drive.
        rd, wr = io["read_gbps"] * GB / meta.get("world", 1), io["write_gbps"] * GB / meta.get("world", 1)
        fb_io = off["fb_read"] / rd + off["fb_written"] / wr
        opt_io = (off["own_read"] - off["fb_read"]) / rd + (off["own_written"] - off["fb_written"]) / wr
        res["phase_bound"] = {"fb_io_s": fb_io, "opt_io_s": opt_io,
                              "s": max(mem["fb_s"], fb_io) + max(mem["opt_s"], opt_io)}
        res["ratios"]["offload_vs_phase_bound"] = off["s"] / res["phase_bound"]["s"]

    def ratio(c: dict, d: float | None) -> float | None:
        return c["s"] / d if "s" in c and d else None

    res["ratios"]["offload_vs_bound"] = ratio(off, res.get("bound"))
    res["ratios"]["offload_vs_memory"] = ratio(off, mem.get("s"))
    if "s" in ds and "s" in off:
        res["ratios"]["deepspeed_vs_offload"] = ds["s"] / off["s"]
    elif "deepspeed" in cells:
        res["ratios"]["deepspeed_error"] = "failed: " + ("; ".join(ds.get("errors", [])) or "no sample")
    if "losses" in mem and "losses" in off:
        same = mem["losses"] == off["losses"]
        res["checks"]["offload_equals_memory"] = (
            "give the same losses at every step, bit for bit" if same else
            f"DIFFER: memory {mem['losses']} offload {off['losses']}")
    else:
        res["checks"]["offload_equals_memory"] = "not compared (one of them did not run)"
    if drive is not None:
        res["raw_settings"] = {d: s or "recommended" for d, s in drive.best.items()}
        res["raw_tried"] = drive.tried
    return res


if __name__ == "__main__":
    sys.exit(main())
