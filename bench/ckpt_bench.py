#!/usr/bin/env python3
"""Checkpoint save/load speed: deepnvme beside torch, safetensors and torch.distributed.checkpoint, one run.

    python3 bench/ckpt_bench.py [--dir DIR] [--repeats 3] [--small | --quick] [--rest 1] [--out PREFIX]

State dicts: a GPT-2-medium-like one (355 M float32 parameters, ~1.42 GB: many small, some large tensors)
and one of 4 GiB (16 tensors of 256 MiB); --small uses GPT-2-small-like (~0.5 GB) and 1 GiB instead;
--quick measures only the GPT-2-medium-like one and only the contenders deepnvme.save/load's targets
compare (torch.save/torch.load, deepnvme.save/load, the raw handle), 3 repeats: about a minute on a quiet
machine, where the full run takes about 6 minutes (the 4 GiB state dict's torch.save and DCP rows are most
of it).
Contenders, each saving and then loading the same state dict, in an order rotated every repeat:
  * torch.save + fsync / torch.load (cold) / torch.load(mmap=True) with every page of every tensor touched;
  * safetensors save_file + fsync / load_file, when safetensors is installed (it is not a dependency);
  * DCP FileSystemWriter (thread_count=2) / FileSystemReader;
  * deepnvme.save / deepnvme.load;
  * deepnvme.checkpoint.AioStorageWriter / AioStorageReader with dcp.save / dcp.load in this process, and in
    2 processes (gloo) that each hold half of the tensors;
  * the raw aio_handle: the same tensors written back to back at 4 KiB-aligned offsets of one file with
    async_pwrite + wait + fsync, and read with async_pread + wait into fresh page-aligned tensors (so
    that every read goes O_DIRECT with no copy; torch.empty's memory is 64 bytes past a page and would
    be staged): the ceiling.
Loads start from a cold cache: every file of the checkpoint is evicted (fdatasync + fadvise) after the save.
Every load includes making its tensors (DCP loads into empty ones made inside the timing), and the first
repeat checks every loaded tensor against the saved one. The peak extra resident memory of this process
during each in-process save is the kernel's high-water mark, reset before it (bench/_harness.py).
GB = 10^9 bytes; cells are median (min-max).
Writes markdown to stdout and <out>.md, every sample to <out>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _harness import ROOT, PeakMemory, wall  # puts this checkout on sys.path before deepnvme is imported

from deepnvme._core.aio_types import AioHandle  # noqa: E402
from deepnvme.tools.pagecache import drop_file_cache, o_direct_works  # noqa: E402
from deepnvme.tools.resident import touch_pages  # noqa: E402

GIB = 1 << 30
ALIGN = 4096
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# ------------------------------------------------------------------------------------------ state dicts
Shapes = list[tuple[str, tuple[int, ...]]]


def gpt2_shapes(layers: int, d: int, vocab: int = 50257, ctx: int = 1024) -> Shapes:
    """Parameter names and shapes of a GPT-2 of `layers` blocks and width `d` (HF naming, Conv1D layout)."""
    shapes: Shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
                   (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    return shapes + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def big_shapes(total: int) -> Shapes:
    """`total` bytes of float32 as 256 MiB tensors."""
    each = 256 << 20
    return [(f"block.{i}", (each // 4,)) for i in range(total // each)]


def make_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor whose bytes depend on its name (fast to make and to check; incompressible enough)."""
    n = 1
    for s in shape:
        n *= s
    seed = sum(map(ord, name)) * 2654435761 % (1 << 31)
    t = torch.arange(n, dtype=torch.int32).mul_(1103515245).add_(seed)
    return t.view(torch.float32).view(shape)


def make_state(shapes: Shapes) -> dict[str, torch.Tensor]:
    """The state dict itself."""
    return {name: make_tensor(name, shape) for name, shape in shapes}


def nbytes_of(shapes: Shapes) -> int:
    """Bytes of tensor data in a state dict of these shapes."""
    total = 0
    for _, shape in shapes:
        n = 4
        for s in shape:
            n *= s
        total += n
    return total


def check_state(got: dict[str, Any], shapes: Shapes, who: str) -> None:
    """Every tensor loaded equals the one saved, or the bench stops: a fast wrong answer is no answer."""
    for name, shape in shapes:
        t = got.get(name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise RuntimeError(f"{who}: {name} missing or of the wrong shape/dtype")
        if not torch.equal(t.view(torch.int32), make_tensor(name, shape).view(torch.int32)):
            raise RuntimeError(f"{who}: {name} differs from what was saved")


def halves(shapes: Shapes) -> list[Shapes]:
    """Split the tensors over two ranks with similar byte counts (largest first, each to the lighter)."""
    parts: list[Shapes] = [[], []]
    sizes = [0, 0]
    for item in sorted(shapes, key=lambda s: -nbytes_of([s])):
        i = sizes.index(min(sizes))
        parts[i].append(item)
        sizes[i] += nbytes_of([item])
    return parts


# ------------------------------------------------------------------------------------------ measuring
def files_under(path: Path) -> list[Path]:
    """The checkpoint's files (one file, or a DCP directory's)."""
    return [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]


def evict(path: Path) -> None:
    """Cold cache for the load: flush and drop every file of the checkpoint."""
    for p in files_under(path):
        drop_file_cache(str(p))


def remove(path: Path) -> None:
    """Delete a checkpoint (file or directory)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def fsync_file(path: Path) -> None:
    """Push a file written through the page cache to the drive, as a checkpoint must be."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch_all(sd: dict[str, torch.Tensor]) -> None:
    """Fault in every page of every tensor (for mmap loads, which read lazily)."""
    seen = set()
    for t in sd.values():
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        torch.empty(0, dtype=torch.uint8).set_(s)[::ALIGN].sum()


# ------------------------------------------------------------------------------------------ contenders
@dataclass
class Contender:
    """Save and load functions over one state dict; load returns the state dict it made."""

    name: str
    save: Callable[[dict[str, torch.Tensor], Path], Any] | None  # out of process: returns its seconds
    load: Callable[[Path, Shapes], Any] | None
    kind: str  # which checkpoint the load reads: its own save's
    samples: dict[str, list[float]] = field(default_factory=lambda: {"save": [], "load": [], "rss": []})
    in_process: bool = True


def empty_like_shapes(shapes: Shapes) -> dict[str, torch.Tensor]:
    """Fresh tensors to load into (made inside the timing: every load starts from nothing)."""
    return {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes}


def torch_save(sd: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save, then fsync."""
    torch.save(sd, path)
    fsync_file(path)


def raw_write(handle: AioHandle) -> Callable[[dict[str, torch.Tensor], Path], None]:
    """The handle alone: every tensor at the next 4 KiB-aligned offset of one file, then wait and fsync."""
    def save(sd: dict[str, torch.Tensor], path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            offset = 0
            for t in sd.values():
                handle.async_pwrite(t.view(-1).view(torch.uint8), fd, offset)
                offset += -(-t.nbytes // ALIGN) * ALIGN
            handle.wait()
            os.fsync(fd)
        finally:
            os.close(fd)
    return save


def empty_aligned_like_shapes(shapes: Shapes) -> dict[str, torch.Tensor]:
    """Fresh page-aligned float32 tensors (the async_io op's empty_at_residue, as deepnvme.load uses)."""
    from deepnvme import AsyncIOBuilder

    empty_at_residue = AsyncIOBuilder().load().empty_at_residue
    return {name: empty_at_residue(nbytes_of([(name, shape)]), 0).view(torch.float32).view(shape)
            for name, shape in shapes}


def raw_read(handle: AioHandle) -> Callable[[Path, Shapes], dict[str, Any]]:
    """Read the raw file back into fresh page-aligned tensors with async_pread, one wait."""
    def load(path: Path, shapes: Shapes) -> dict[str, Any]:
        out = empty_aligned_like_shapes(shapes)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            offset = 0
            for t in out.values():
                handle.async_pread(t.view(-1).view(torch.uint8), fd, offset)
                offset += -(-t.nbytes // ALIGN) * ALIGN
            handle.wait()
        finally:
            os.close(fd)
        return out
    return load


def contenders(handle: AioHandle, pool: RankPool | None, quick: bool = False) -> list[Contender]:
    """Everything measured, in its base order (quick: only what deepnvme.save/load's targets compare)."""
    import torch.distributed.checkpoint as dcp

    import deepnvme
    from deepnvme.checkpoint import AioStorageReader, AioStorageWriter

    def dcp_load(reader_cls: Any) -> Callable[[Path, list], dict[str, Any]]:
        def load(path: Path, shapes: list) -> dict[str, Any]:
            out = empty_like_shapes(shapes)
            dcp.load(out, storage_reader=reader_cls(path))
            return out
        return load

    def mmap_load(path: Path, shapes: list) -> dict[str, Any]:
        sd = torch.load(path, mmap=True, weights_only=True)
        touch_all(sd)
        return sd

    torch_pair = Contender("torch.save + fsync / torch.load", torch_save,
                           lambda p, s: torch.load(p, weights_only=True), "torch")
    ours = Contender("deepnvme.save / deepnvme.load", lambda sd, p: deepnvme.save(sd, p),
                     lambda p, s: deepnvme.load(p), "deepnvme")
    raw = Contender("raw aio_handle write (+fsync) / read, same bytes", raw_write(handle), raw_read(handle),
                    "raw")
    if quick:
        return [torch_pair, ours, raw]
    out = [torch_pair, Contender("torch.load(mmap=True), every page touched", None, mmap_load, "torch")]
    try:
        from safetensors.torch import load_file, save_file

        def st_save(sd: dict[str, torch.Tensor], path: Path) -> None:
            save_file(sd, str(path))
            fsync_file(path)

        out.append(Contender("safetensors save_file + fsync / load_file", st_save,
                             lambda p, s: load_file(str(p)), "safetensors"))
    except ImportError:
        pass
    out += [
        Contender("DCP FileSystemWriter (2 threads) / FileSystemReader",
                  lambda sd, p: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=2)),
                  dcp_load(dcp.FileSystemReader), "dcp-fs"),
        ours,
        Contender("DCP AioStorageWriter / AioStorageReader, 1 process",
                  lambda sd, p: dcp.save(sd, storage_writer=AioStorageWriter(p)),
                  dcp_load(AioStorageReader), "dcp-aio"),
    ]
    if pool is not None:
        out.append(Contender("DCP AioStorageWriter / AioStorageReader, 2 processes (gloo)",
                             pool.save, pool.load, "dcp-aio-2p", in_process=False))
    out.append(raw)
    return out


# ------------------------------------------------------------------------------------------ 2 ranks
def rank_main(rank: int, port: int, conn: Any, root: str) -> None:
    """A rank of the 2-process DCP contender: saves/loads its half of the tensors on command, timed
    between barriers so the figure covers both ranks' work."""
    sys.path.insert(0, root)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from deepnvme.checkpoint import AioStorageReader, AioStorageWriter

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        while True:
            cmd, path, shapes, check = conn.recv()
            if cmd == "quit":
                break
            mine = halves(shapes)[rank]
            if cmd == "save":
                sd = make_state(mine)
                dist.barrier()
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=AioStorageWriter(path))
                dist.barrier()
                conn.send(time.perf_counter() - t0)
                del sd
            else:
                dist.barrier()
                t0 = time.perf_counter()
                sd = empty_like_shapes(mine)
                dcp.load(sd, storage_reader=AioStorageReader(path))
                dist.barrier()
                took = time.perf_counter() - t0
                if check:
                    check_state(sd, mine, f"2-process DCP load, rank {rank}")
                conn.send(took)
                del sd
    except BaseException as exc:  # tell the parent rather than leave it waiting
        conn.send(exc)
        raise
    finally:
        dist.destroy_process_group()


class RankPool:
    """Two rank processes for the 2-process DCP contender, kept for the whole run."""

    def __init__(self) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(rank, port, child, str(ROOT)), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.shapes: list = []
        self.check = False

    def _call(self, cmd: str, path: Path) -> float:
        for c in self.conns:
            c.send((cmd, str(path), self.shapes, self.check))
        times = []
        for c in self.conns:
            if not c.poll(600):
                raise TimeoutError(f"2-process DCP {cmd} did not answer within 600 s")
            got = c.recv()
            if isinstance(got, BaseException):
                raise RuntimeError(f"2-process DCP {cmd} failed in a rank") from got
            times.append(got)
        return max(times)

    def save(self, sd: dict[str, torch.Tensor], path: Path) -> float:
        """Both ranks save their halves (made in the ranks, not sent); returns seconds between barriers."""
        return self._call("save", path)

    def load(self, path: Path, shapes: list) -> float:
        """Both ranks load their halves; returns the seconds between barriers (the ranks check the data)."""
        return self._call("load", path)

    def close(self) -> None:
        """Stop the ranks."""
        for c in self.conns:
            try:
                c.send(("quit", "", [], False))
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# ------------------------------------------------------------------------------------------ the run
def measure(c: Contender, sd: dict[str, torch.Tensor], shapes: list, workdir: Path, first: bool,
            rest: float, saved: dict[str, Path], pool: RankPool | None) -> None:
    # pool: the 2-process contender's ranks; told which tensors to make and whether to check them
    """One save (if any) and one cold load (if any) of contender `c`; samples appended to c.samples."""
    suffix = {"torch": ".pt", "safetensors": ".safetensors", "deepnvme": ".pt", "raw": ".bin"}.get(c.kind, "")
    path = workdir / f"ckpt_{c.kind}{suffix}"
    if c.save is not None:
        remove(path)
        time.sleep(rest)
        if not c.in_process:
            if pool is not None:
                pool.shapes, pool.check = shapes, first
            c.samples["save"].append(c.save(sd, path))
        else:
            touch_pages(*(t for t in sd.values() if isinstance(t, torch.Tensor)))  # deepnvme.tools.resident
            with PeakMemory() as peak:
                c.samples["save"].append(wall(lambda: c.save(sd, path)))
            c.samples["rss"].append(peak.extra)
        saved[c.kind] = path
    if c.load is not None:
        path = saved[c.kind]
        evict(path)
        time.sleep(rest)
        if not c.in_process:
            c.samples["load"].append(c.load(path, shapes))
        else:
            loaded: list[Any] = []
            c.samples["load"].append(wall(lambda: loaded.append(c.load(path, shapes))))
            got = loaded.pop()
            if first:
                check_state(got, shapes, c.name)
            del got


def cell(nbytes: int, seconds: list[float]) -> str:
    """GB/s as median (min-max)."""
    if not seconds:
        return "—"
    rates = sorted(nbytes / s / 1e9 for s in seconds)
    return f"{statistics.median(rates):.2f} ({rates[0]:.2f}–{rates[-1]:.2f})"


def median_rate(nbytes: int, seconds: list[float]) -> float | None:
    """Median GB/s, or None when not measured."""
    return statistics.median(nbytes / s / 1e9 for s in seconds) if seconds else None


def report(label: str, nbytes: int, count: int, cs: list[Contender], repeats: int) -> list[str]:
    """The table and ratios for one state dict."""
    lines = [f"### {label}: {nbytes / 1e9:.2f} GB in {count} tensors, {repeats} repeats", "",
             "| contender | save GB/s | load GB/s (cold) | peak extra RSS during save |",
             "| --- | --- | --- | --- |"]
    for c in cs:
        rss = f"{statistics.median(c.samples['rss']) / 2**20:.0f} MiB" if c.samples["rss"] else "—"
        save, load = cell(nbytes, c.samples["save"]), cell(nbytes, c.samples["load"])
        lines.append(f"| {c.name} | {save} | {load} | {rss} |")
    by = {c.kind + ("-mmap" if "mmap" in c.name else ""): c for c in cs}

    def ratio(kind: str, base: str, op: str, target: float, what: str) -> str | None:
        """Ratio of medians, and the median of the per-repeat ratios (each repeat's two samples were taken
        minutes apart at most, so this one is less exposed to a load that drifts over the run)."""
        a, b = by.get(kind), by.get(base)
        if a is None or b is None or not a.samples[op] or not b.samples[op]:
            return None
        r = median_rate(nbytes, a.samples[op]) / median_rate(nbytes, b.samples[op])
        paired = statistics.median(y / x for x, y in zip(a.samples[op], b.samples[op]))
        return (f"- {what}: {r:.2f}× (per-repeat {paired:.2f}×; target ≥ {target}×: "
                f"{'met' if r >= target else 'NOT met'})")

    found = [ratio("deepnvme", "raw", "save", 0.8, "deepnvme.save / raw handle write"),
             ratio("deepnvme", "torch", "save", 4, "deepnvme.save / torch.save+fsync"),
             ratio("deepnvme", "raw", "load", 0.8, "deepnvme.load / raw handle read"),
             ratio("deepnvme", "torch", "load", 1.5, "deepnvme.load / cold torch.load"),
             ratio("dcp-aio", "dcp-fs", "save", 3, "AioStorageWriter 1 proc / FileSystemWriter"),
             ratio("dcp-aio", "dcp-fs", "load", 2, "AioStorageReader 1 proc / FileSystemReader"),
             ratio("dcp-aio-2p", "dcp-fs", "save", 3, "AioStorageWriter 2 procs / FileSystemWriter (1 proc)"),
             ratio("dcp-aio-2p", "dcp-fs", "load", 2, "AioStorageReader 2 procs / FileSystemReader (1 proc)"),
             ratio("dcp-aio", "raw", "save", 0.8, "AioStorageWriter 1 proc / raw handle write"),
             ratio("dcp-aio", "raw", "load", 0.8, "AioStorageReader 1 proc / raw handle read")]
    lines += ["", "Ratios of medians:", *(line for line in found if line is not None), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run every contender over both state dicts, interleaved, and write the tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=str(ROOT / "_bench_out" / "ckpt"), help="where checkpoints are written")
    ap.add_argument("--repeats", type=int, default=3)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="GPT-2-small-like (~0.5 GB) and 1 GiB state dicts")
    size.add_argument("--quick", action="store_true",
                      help="GPT-2-medium-like only; torch, deepnvme.save/load and the raw handle only")
    ap.add_argument("--rest", type=float, default=1.0, help="seconds of rest before each timed operation")
    ap.add_argument("--no-2proc", action="store_true", help="skip the 2-process DCP contender")
    ap.add_argument("--out", default=str(ROOT / "_bench_out" / "ckpt_bench"),
                    help="output prefix (.md, .json)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.rest < 0:
        ap.error("--repeats must be >= 1 and --rest >= 0")
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)

    from deepnvme._core.handles import RECOMMENDED, default_handle

    handle = default_handle()
    if args.small:
        dicts = [("GPT-2-small-like", gpt2_shapes(12, 768)), ("1 GiB, 4 x 256 MiB", big_shapes(GIB))]
    elif args.quick:
        dicts = [("GPT-2-medium-like", gpt2_shapes(24, 1024))]
    else:
        dicts = [("GPT-2-medium-like", gpt2_shapes(24, 1024)), ("4 GiB, 16 x 256 MiB", big_shapes(4 * GIB))]
    pool = None if args.no_2proc or args.quick else RankPool()
    started = time.time()
    lines: list[str] = []
    record: dict[str, Any] = {"argv": sys.argv, "results": {}}
    try:
        for label, shapes in dicts:
            sd = make_state(shapes)
            nbytes = nbytes_of(shapes)
            cs = contenders(handle, pool, args.quick)
            saved: dict[str, Path] = {}
            for rep in range(args.repeats):
                order = cs[rep % len(cs):] + cs[:rep % len(cs)]  # rotate: nobody always goes first
                # a load reads its own contender's save: keep loads after their saves within the repeat
                for c in sorted(order, key=lambda c: 0 if c.save is not None else 1):
                    measure(c, sd, shapes, workdir, rep == 0, args.rest, saved, pool)
                print(f"[{label}] repeat {rep + 1}/{args.repeats} done at {time.time() - started:.0f} s",
                      file=sys.stderr, flush=True)
            for p in saved.values():
                remove(p)
            lines += report(label, nbytes, len(shapes), cs, args.repeats)
            record["results"][label] = {"bytes": nbytes, "tensors": len(shapes),
                                        "contenders": {c.name: c.samples for c in cs}}
            del sd
    finally:
        if pool is not None:
            pool.close()
    st = "installed" if any("safetensors" in c.name for c in cs) else \
        "not installed here (not a dependency of deepnvme): its rows are skipped"
    head = [f"Command: `python3 bench/ckpt_bench.py {' '.join(sys.argv[1:])}`", "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}, torch "
            f"{torch.__version__}; checkpoints in {workdir} "
            f"(O_DIRECT {'works' if o_direct_works(str(workdir)) else 'refused'})"
            f"; handle {RECOMMENDED} ({handle.get_engine()}); safetensors {st}; "
            f"run took {time.time() - started:.0f} s.", ""]
    text = "\n".join(head + lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(text + "\n")
    Path(args.out + ".json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
