#!/usr/bin/env python3
"""Checkpoint save/load speed against the bound: one raw transfer of the same bytes at the best settings.

    python3 bench/ckpt_bench.py [--dir DIR] [--repeats 3] [--pilot 2] [--small | --quick] [--all]
                                [--rest 0.5] [--out PREFIX]

State dicts: a GPT-2-medium-like one (355 M float32 parameters, ~1.42 GB: many small, some large tensors)
and one of 4 GiB (16 tensors of 256 MiB); --small uses GPT-2-small-like (~0.5 GB) and 1 GiB instead,
--quick the GPT-2-medium-like one alone.
Contenders, each saving and then loading the same state dict, in an order rotated every repeat:
  * torch.save + fsync / torch.load (cold);
  * deepnvme.save / deepnvme.load, no handle passed (the checkpoint default, or a tuned file's);
  * deepnvme.checkpoint.AioStorageWriter / AioStorageReader with dcp.save / dcp.load in this process;
  * the bound: the bytes of deepnvme.save's file in one locked buffer, moved by one sync_pwrite (+ fsync)
    to a new file and one sync_pread back into that buffer. A pilot (--pilot repeats, before the run)
    measures every point of a grid of handle settings (block 1/4/8 MiB x queue depth 32/128 x 1/2 threads);
    the 3 points with the best medians of each operation are then measured again in the run, interleaved
    with the contenders, and the best of those new medians is the bound (the pilot's best median is the
    largest of twelve noisy ones, and would read high);
  * for reference: the raw write with deepnvme.save's handle, under a temporary name, fsynced and committed
    as deepnvme.save commits (rename over the name, fsync of the directory): what atomicity adds to a save;
  * for reference, not bounds: one sync_pread of that file into fresh memory with that handle
    (what any load that returns new tensors pays: the memory's first-touch faults), page-aligned (read
    O_DIRECT into it, the pages faulted by the reads) and 64 bytes past a page (where torch's allocator
    puts a tensor: the handle reads into its locked staging pool and its worker threads copy out, faulting
    the pages as they copy); with the row below that fills new memory without zeroing, the best of them
    is the best raw read into new memory here;
  * for reference: deepnvme.load with its large payloads read O_DIRECT into their own memory (placed at the
    file's page residue; serialization.FILL_FRESH and STAGE_PAYLOADS off), beside the default, which
    stages them;
  * for reference: deepnvme.load as it runs by default, its large payloads' memory made before the clock
    (mappings of the tensors' sizes, every page written), so that it and deepnvme.load differ only by what
    making new memory costs a load here;
  * for reference: deepnvme.load with its new memory zeroed by the kernel before the staged copies
    (serialization.FILL_FRESH off), beside the default, which fills new pages without zeroing them
    (userfaultfd), and the raw read into new memory filled that way; both only where this process may use
    userfaultfd;
  * for reference, reading nothing: the state dict's bytes of new anonymous memory made on every core at
    once, in 4 KiB pages and in transparent huge pages; the faster is a ceiling on this machine for any load
    whose new memory the kernel zeroes (see MEMORY_ONLY);
--all adds torch.load(mmap=True) with every page touched, safetensors (when installed), DCP
FileSystemWriter/Reader and AioStorageWriter/Reader in 2 processes (gloo).
Loads start from a cold cache: every file of the checkpoint is evicted (fdatasync + fadvise) before it.
Every timed read is of a file written moments before: the load-only references write theirs again,
untimed, before their loads (a second read of a file soon after its first often ran slower here).
Before every timed operation the garbage collector runs a full collection (see settle()).
Every load of a whole file includes making its tensors, in new memory as a process's first load does
(glibc's mmap threshold is fixed and freed memory handed back before each operation, so no load reuses
memory an earlier one freed: _harness.large_allocations_new, release_freed). DCP loads into tensors the
caller already has (a model's initialized state dict), so its destinations are made and written to (every
page touched) before the timing, as a model's would be: timing fresh torch.empty destinations would charge
DCP the first-touch faults of memory no real DCP load makes. The first repeat checks every loaded tensor
against the saved one.
For each in-process operation: wall seconds, CPU seconds of this process (all threads), and the peak extra
resident memory (the kernel's high-water mark, bench/_harness.py; a load's includes the state it returns,
less any memory the allocator reuses). GB = 10^9 bytes; cells are median (min-max). Writes markdown to
stdout and <out>.md, every sample to <out>.json (default bench/results/ckpt).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
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

# _harness first: it puts this checkout on sys.path before deepnvme is imported
from _harness import MMAP_THRESHOLD, ROOT, PeakMemory, large_allocations_new, release_freed, timed

from deepnvme._core.aio_types import AioHandle  # noqa: E402
from deepnvme._core.memory import PAGE  # noqa: E402
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
    """Save and load functions over one state dict; load returns the state dict it made (None: nothing to
    check, the raw transfers)."""

    name: str
    save: Callable[[dict[str, torch.Tensor], Path], Any] | None  # out of process: returns its seconds
    load: Callable[[Path, Any], Any] | None  # given the path and prepare(shapes), or the shapes
    kind: str  # which checkpoint the load reads: its own save's, or that of the contender of this kind
    # "main" (the table), "grid" (measured in the pilot), "bound" (one of the pilot's best points, measured
    # again beside the contenders), "reference"
    group: str = "main"
    samples: dict[str, list[float]] = field(default_factory=lambda: {
        "save": [], "load": [], "save_cpu": [], "load_cpu": [], "save_rss": [], "load_rss": []})
    in_process: bool = True
    # What the load is given, made before the timing (DCP: the caller's existing state dict).
    prepare: Callable[[Shapes], Any] | None = None
    bound_for: tuple[str, ...] = ()  # group "bound": the operations ("save", "load") it is the bound of
    # A load-only contender's file written again just before its load, untimed: every timed read is then of
    # a file written moments before, as every saving contender's is (a file's second read, soon after its
    # first, often ran slower on this host than its first).
    rewrite: Callable[[dict[str, torch.Tensor], Path], Any] | None = None


def initialized_like_shapes(shapes: Shapes) -> dict[str, torch.Tensor]:
    """Tensors to load into as a model holds them: allocated and written (every page exists)."""
    return {name: torch.empty(shape, dtype=torch.float32).fill_(0.5) for name, shape in shapes}


# The reference load whose large payloads are read O_DIRECT into their own memory, not staged.
DIRECT = "deepnvme.load, large payloads read O_DIRECT into their own memory"
# The reference load whose new memory the kernel zeroes before the staged reads' copies overwrite it, as
# before deepnvme.load filled it through userfaultfd (serialization.FILL_FRESH).
ZEROED = "deepnvme.load, its new memory zeroed by the kernel first (FILL_FRESH off), staged"
# The raw read into new memory that deepnvme.load's own payloads get.
FILLED_FRESH = ("raw read into fresh memory filled without zeroing (userfaultfd), staged (checkpoint handle)")
# The reference load whose new tensors' memory exists before the clock starts: what a load that returns new
# tensors pays for making their pages is the difference between it and deepnvme.load.
MADE_BEFORE = "deepnvme.load, its payloads' memory made (every page written) before the clock"


# The references that read nothing: the loaded state's bytes of new anonymous memory made (the kernel zeroes
# each page), on every core at once, in 4 KiB pages and in transparent huge pages. A load that lets the kernel
# zero its new memory makes at least that much of it, on at most that many cores: the faster row is a ceiling
# for such a load on this machine, whatever the disk does. Not for deepnvme.load where it fills its pages
# without their zeroing (serialization.FILL_FRESH), nor for a load whose tensors are the file's page cache
# (torch.load(mmap=True)) or memory the process held before.
MEMORY_ONLY = ("no read: the state dict's bytes of new memory made, nothing else (4 KiB pages faulted in on "
               "every core at once, MADV_POPULATE_WRITE)")
MEMORY_ONLY_HUGE = ("no read: the state dict's bytes of new memory made, nothing else (transparent huge "
                    "pages, MADV_HUGEPAGE, faulted in on every core at once)")


def unmade_memory(shapes: Shapes, huge: bool = False) -> mmap.mmap:
    """An anonymous mapping of the state dict's bytes, none of its pages made yet (mmap faults none in);
    `huge`: advised for transparent huge pages (RuntimeError when refused)."""
    block = mmap.mmap(-1, nbytes_of(shapes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError) as exc:  # no such advice here, or the kernel refuses it
            raise RuntimeError(f"{MEMORY_ONLY_HUGE}: madvise(MADV_HUGEPAGE) refused: {exc}") from exc
    return block


def make_memory(block: mmap.mmap, threads: int | None = None) -> None:
    """Fault in every page of `block`, `threads` (default: one per core this process may run on) each
    making one contiguous share of it, POPULATE_CHUNK_BYTES per call (ctypes lets go of the GIL, so the
    threads run at once); RuntimeError when the kernel refuses (a figure for memory not made would be no
    figure)."""
    import threading

    from deepnvme._core import memory

    view = torch.frombuffer(block, dtype=torch.uint8)
    base, size = view.data_ptr(), len(block)
    threads = threads or len(os.sched_getaffinity(0))
    per = -(-size // threads)
    share = memory.round_up(per)  # whole pages, the last share the rest
    chunk = memory.POPULATE_CHUNK_BYTES
    refused: list[int] = []

    def run(start: int, end: int) -> None:
        for at in range(start, end, chunk):
            err = memory.madvise(base + at, min(chunk, end - at), memory.MADV_POPULATE_WRITE)
            if err:
                refused.append(err)
                return

    workers = [threading.Thread(target=run, args=(a, min(a + share, size))) for a in range(0, size, share)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    del view
    if refused:
        raise RuntimeError(f"{MEMORY_ONLY}: madvise(MADV_POPULATE_WRITE) refused: {os.strerror(refused[0])}")


def memory_rows() -> list[Contender]:
    """The rows that read nothing (MEMORY_ONLY, MEMORY_ONLY_HUGE), each only where this kernel does what it
    needs (tried on a small mapping first: a refusal in the run would end it)."""
    out = []
    for name, huge in ((MEMORY_ONLY, False), (MEMORY_ONLY_HUGE, True)):
        try:
            make_memory(unmade_memory([("probe", (1 << 19,))], huge), 1)
        except RuntimeError as exc:
            print(f"not measured: {exc}", file=sys.stderr)
            continue
        out.append(Contender(name, None, lambda p, block: make_memory(block), "deepnvme", group="reference",
                             prepare=lambda shapes, huge=huge: unmade_memory(shapes, huge)))
    return out


def memory_made_before(shapes: Shapes) -> dict[int, list[mmap.mmap]]:
    """Memory for every tensor's payload, by its size, each page already written: a page more than the
    tensor so that load can place it at any offset from a page."""
    pool: dict[int, list[mmap.mmap]] = {}
    for _, shape in shapes:
        nbytes = torch.empty(shape, dtype=torch.float32, device="meta").nbytes
        block = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        torch.frombuffer(block, dtype=torch.uint8).fill_(1)
        pool.setdefault(nbytes, []).append(block)
    return pool


def torch_save(sd: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save, then fsync."""
    torch.save(sd, path)
    fsync_file(path)


class LockedBytes:
    """The bytes of one deepnvme.save file in one locked buffer: what every raw transfer moves."""

    def __init__(self, sd: dict[str, torch.Tensor], workdir: Path) -> None:
        import deepnvme
        from deepnvme._core.handles import checkpoint_handle

        probe = workdir / "bound_source.pt"
        deepnvme.save(sd, probe)
        self.handle = checkpoint_handle(workdir)
        self.nbytes = probe.stat().st_size
        self.buffer = self.handle.new_cpu_locked_tensor(self.nbytes, torch.empty(0, dtype=torch.uint8))
        self.handle.sync_pread(self.buffer, str(probe))
        probe.unlink()

    def free(self) -> None:
        """Unlock and free the buffer (a locked buffer is not the allocator's: it is given back here)."""
        self.handle.free_cpu_locked_tensor(self.buffer)


def raw_grid(source: LockedBytes) -> list[Contender]:
    """The bound's candidates: one raw write (+ fsync) and one raw read of the file's bytes per setting."""
    from aio_cases import Setting, handle_settings

    from deepnvme._core.handles import new_handle

    engine = source.handle.get_engine()
    out = []
    for block in (1 << 20, 4 << 20, 8 << 20):
        for depth in (32, 128):
            for threads in (1, 2):
                point = Setting(block, depth, threads)
                h = new_handle(**handle_settings(engine, depth, threads, block))
                out.append(Contender(f"raw {point.label()}", raw_write(h, source), raw_read(h, source),
                                     f"raw-{block >> 20}M-{depth}-{threads}", group="grid"))
    return out


# Grid points per operation carried from the pilot into the run; the bound is the best of their new medians.
CANDIDATES = 3


def confirmed_bounds(grid: list[Contender], nbytes: int) -> list[Contender]:
    """The pilot's CANDIDATES best grid points for each operation, as contenders of their own for the run.

    The pilot picks the settings; the bound's figure comes from these new samples (the best candidate's
    median in the run). Taking the best of a dozen pilot medians as the figure would read high: on this
    host the medians of equal settings spread by a third, and the largest of twelve is the luckiest, not
    the fastest. Carrying a few points, not one, keeps a pilot that ranked them by noise from leaving the
    bound on a slow one; the best of three still reads a little high, never low."""
    top = {op: sorted(grid, key=lambda c: median_rate(nbytes, c.samples[op]), reverse=True)[:CANDIDATES]
           for op in ("save", "load")}
    out = []
    for c in grid:
        ops = tuple(op for op in ("save", "load") if any(c is t for t in top[op]))
        if not ops:
            continue
        # A read's candidate writes its own file to read (that write is reported only if it is a write's
        # candidate too); a write's candidate that is not a read's reads nothing: a cold read nobody
        # reports would only lengthen the run and disturb its neighbours.
        out.append(Contender(f"bound {c.name}", c.save, c.load if "load" in ops else None, f"{c.kind}-bound",
                             group="bound", bound_for=ops))
    return out


def contenders_record(cs: list[Contender]) -> dict[str, Any]:
    """Every contender's samples for the JSON, with its group ("grid": the pilot's, before the run) and,
    for the bound, the operations it is the bound of."""
    return {c.name: {"group": c.group, **({"bound_for": list(c.bound_for)} if c.bound_for else {}),
                     **c.samples} for c in cs}


def raw_references(source: LockedBytes) -> list[Contender]:
    """Raw transfers with deepnvme.save's own handle for reference (the checkpoint default, or the
    directory's tuned settings: the ratios to deepnvme.save/load compare like with like): the write
    committed atomically, and reads of its file into fresh memory."""
    return [Contender("raw write + fsync, then the atomic commit: rename over the name, fsync of the "
                      "directory (checkpoint handle)", raw_write(source.handle, source, atomic=True), None,
                      "raw-atomic", group="reference"),
            Contender("raw read into fresh page-aligned memory (checkpoint handle)", None,
                      raw_read_fresh(source, 0), "raw-atomic", group="reference",
                      rewrite=raw_write(source.handle, source)),
            Contender("raw read into fresh memory 64 bytes past a page, staged (checkpoint handle)", None,
                      raw_read_fresh(source, 64), "raw-atomic", group="reference",
                      rewrite=raw_write(source.handle, source)),
            *([Contender(FILLED_FRESH, None, raw_read_fresh(source, 0, filled=True), "raw-atomic",
                         group="reference", rewrite=raw_write(source.handle, source))]
              if fresh_filling() else [])]


def raw_write(h: AioHandle, source: LockedBytes, atomic: bool = False
              ) -> Callable[[dict[str, torch.Tensor], Path], None]:
    """One sync_pwrite of the locked buffer to a new file, then fsync; `atomic`: written under a temporary
    name and committed as deepnvme.save commits (rename, fsync of the directory), the cost of atomicity that
    the bound does not pay."""
    from op_builder.atomic_file import commit

    def save(sd: dict[str, torch.Tensor], path: Path) -> None:
        target = path.with_name(path.name + ".tmp") if atomic else path
        h.sync_pwrite(source.buffer, str(target))
        fsync_file(target)
        if atomic:
            commit(str(target), str(path))
    return save


def raw_read(h: AioHandle, source: LockedBytes) -> Callable[[Path, Shapes], None]:
    """One sync_pread of the whole file back into the locked buffer."""
    def load(path: Path, shapes: Shapes) -> None:
        h.sync_pread(source.buffer, str(path))
    return load


def raw_read_fresh(source: LockedBytes, residue: int, filled: bool = False) -> Callable[[Path, Shapes], None]:
    """One sync_pread of the whole file into memory made for it (never touched before), starting `residue`
    bytes past a page; `filled`: memory whose pages the read fills without the kernel zeroing them first
    (the op's empty_fresh, as deepnvme.load's own)."""
    from deepnvme._core.op import aio_module

    def load(path: Path, shapes: Shapes) -> None:
        op = aio_module()
        fresh = (op.empty_fresh if filled else op.empty_at_residue)(source.nbytes, residue)
        source.handle.sync_pread(fresh, str(path))
        if filled:
            op.settle_fresh(fresh)
    return load


def fresh_filling() -> bool:
    """Whether this process fills new memory without zeroing it (userfaultfd: the op's fresh_memory_status),
    as deepnvme.load then does; the rows about it are left out where it does not."""
    from deepnvme._core.op import aio_module

    return aio_module().fresh_memory_status() == "ok"


def contenders(pool: RankPool | None, every: bool) -> list[Contender]:
    """The contenders of the table, in their base order (`every`: the --all ones too)."""
    import torch.distributed.checkpoint as dcp

    import deepnvme
    from deepnvme.checkpoint import AioStorageReader, AioStorageWriter

    def dcp_load(reader_cls: Any) -> Callable[[Path, dict[str, Any]], dict[str, Any]]:
        def load(path: Path, out: dict[str, Any]) -> dict[str, Any]:
            dcp.load(out, storage_reader=reader_cls(path))
            return out
        return load

    def with_settings(**settings: bool) -> Callable[[Path, list], Any]:
        """deepnvme.load with serialization's switches set as given for the load, restored after it."""
        from deepnvme import serialization

        def load(path: Path, shapes: list) -> Any:
            before = {k: getattr(serialization, k) for k in settings}
            for k, v in settings.items():
                setattr(serialization, k, v)
            try:
                return deepnvme.load(path)
            finally:
                for k, v in before.items():
                    setattr(serialization, k, v)
        return load

    def made_before_load(path: Path, pool: dict[int, list[mmap.mmap]]) -> Any:
        from deepnvme.serialization import prefetch

        def take(nbytes: int, residue: int) -> torch.Tensor:
            # No fallback to new memory: that would put making it back on the clock unseen.
            if not pool.get(nbytes):
                raise RuntimeError(f"{MADE_BEFORE}: no memory of {nbytes} bytes was made for this load")
            return torch.frombuffer(pool[nbytes].pop(), dtype=torch.uint8, count=nbytes, offset=residue)

        original = prefetch._payload_memory
        prefetch._payload_memory = lambda: (take, False)
        try:
            return deepnvme.load(path)
        finally:
            prefetch._payload_memory = original

    def mmap_load(path: Path, shapes: list) -> dict[str, Any]:
        sd = torch.load(path, mmap=True, weights_only=True)
        touch_all(sd)
        return sd

    out = [Contender("torch.save + fsync / torch.load", torch_save,
                     lambda p, s: torch.load(p, weights_only=True), "torch")]
    if every:
        out.append(Contender("torch.load(mmap=True), every page touched", None, mmap_load, "torch",
                             rewrite=torch_save))
        try:
            from safetensors.torch import load_file, save_file

            def st_save(sd: dict[str, torch.Tensor], path: Path) -> None:
                save_file(sd, str(path))
                fsync_file(path)

            out.append(Contender("safetensors save_file + fsync / load_file", st_save,
                                 lambda p, s: load_file(str(p)), "safetensors"))
        except ImportError:
            pass
        out.append(Contender("DCP FileSystemWriter (2 threads) / FileSystemReader",
                             lambda sd, p: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p,
                                                                                          thread_count=2)),
                             dcp_load(dcp.FileSystemReader), "dcp-fs", prepare=initialized_like_shapes))
    out += [Contender("deepnvme.save / deepnvme.load", lambda sd, p: deepnvme.save(sd, p),
                      lambda p, s: deepnvme.load(p), "deepnvme"),
            Contender("DCP AioStorageWriter / AioStorageReader, 1 process",
                      lambda sd, p: dcp.save(sd, storage_writer=AioStorageWriter(p)),
                      dcp_load(AioStorageReader), "dcp-aio", prepare=initialized_like_shapes),
            Contender(DIRECT, None, with_settings(FILL_FRESH=False, STAGE_PAYLOADS=False), "deepnvme",
                      group="reference", rewrite=deepnvme.save),
            *([Contender(ZEROED, None, with_settings(FILL_FRESH=False), "deepnvme", group="reference",
                         rewrite=deepnvme.save)] if fresh_filling() else []),
            Contender(MADE_BEFORE, None, made_before_load, "deepnvme", group="reference",
                      prepare=memory_made_before, rewrite=deepnvme.save),
            *memory_rows()]
    if pool is not None:
        out.append(Contender("DCP AioStorageWriter / AioStorageReader, 2 processes (gloo)",
                             pool.save, pool.load, "dcp-aio-2p", in_process=False))
    return out


# ------------------------------------------------------------------------------------------ 2 ranks
def rank_main(rank: int, port: int, conn: Any, root: str) -> None:
    """A rank of the 2-process DCP contender: saves/loads its half of the tensors on command, timed
    between barriers so the figure covers both ranks' work."""
    sys.path.insert(0, root)
    if not large_allocations_new():  # as in the parent (see main)
        print(f"rank {rank}: {NOT_FRESH_NOTE}", file=sys.stderr)
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
                settle(0)
                dist.barrier()
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=AioStorageWriter(path))
                dist.barrier()
                conn.send(time.perf_counter() - t0)
                del sd
            else:
                sd = initialized_like_shapes(mine)  # the caller's state dict, as for the 1-process contender
                settle(0)
                dist.barrier()
                t0 = time.perf_counter()
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
def settle(rest: float) -> None:
    """Before a timed operation: a full collection of the garbage the operations before it left, then the
    rest. A full collection of this process's objects takes about 0.2 s on the 2-core VM; without it the
    collector's thresholds charge it to whichever operation happens to cross them (the Python-heavy loads
    far more often than a raw transfer), as timeit avoids by switching the collector off."""
    gc.collect()
    release_freed()  # what the collection freed goes back to the kernel: the next load makes its memory anew
    time.sleep(rest)


def measure(c: Contender, sd: dict[str, torch.Tensor], shapes: list, workdir: Path, first: bool,
            rest: float, saved: dict[str, Path], pool: RankPool | None) -> None:
    # pool: the 2-process contender's ranks; told which tensors to make and whether to check them
    """One save (if any) and one cold load (if any) of contender `c`; samples appended to c.samples."""
    suffix = {"torch": ".pt", "safetensors": ".safetensors", "deepnvme": ".pt"}.get(c.kind, "")
    suffix = ".bin" if c.kind.startswith("raw") else suffix
    path = workdir / f"ckpt_{c.kind}{suffix}"
    if c.save is not None:
        remove(path)
        settle(rest)
        if not c.in_process:
            if pool is not None:
                pool.shapes, pool.check = shapes, first
            c.samples["save"].append(c.save(sd, path))
        else:
            touch_pages(*(t for t in sd.values() if isinstance(t, torch.Tensor)))  # deepnvme.tools.resident
            with PeakMemory() as peak:
                took, cpu = timed(lambda: c.save(sd, path))
            c.samples["save"].append(took)
            c.samples["save_cpu"].append(cpu)
            c.samples["save_rss"].append(peak.extra)
        saved[c.kind] = path
    if c.load is not None:
        path = saved[c.kind]
        if c.rewrite is not None:
            remove(path)
            c.rewrite(sd, path)
        evict(path)
        settle(rest)
        if not c.in_process:
            c.samples["load"].append(c.load(path, shapes))
            return
        loaded: list[Any] = []
        given = shapes if c.prepare is None else c.prepare(shapes)
        with PeakMemory() as peak:
            took, cpu = timed(lambda: loaded.append(c.load(path, given)))
        del given
        c.samples["load"].append(took)
        c.samples["load_cpu"].append(cpu)
        c.samples["load_rss"].append(peak.extra)
        got = loaded.pop()
        if first and got is not None:
            check_state(got, shapes, c.name)
        del got


def run_repeats(cs: list[Contender], repeats: int, label: str, sd: dict[str, torch.Tensor], shapes: Shapes,
                workdir: Path, rest: float, pool: RankPool | None, started: float) -> None:
    """`repeats` rounds of every contender, grouped by file, the groups' order rotated every round (nobody
    always goes first); the first round checks what the loads return."""
    groups = by_file(cs)
    for rep in range(repeats):
        for group in groups[rep % len(groups):] + groups[:rep % len(groups)]:
            saved: dict[str, Path] = {}
            try:
                for c in group:
                    measure(c, sd, shapes, workdir, rep == 0, rest, saved, pool)
            finally:
                for p in saved.values():  # one checkpoint on the disk at a time
                    remove(p)
        print(f"[{label}] repeat {rep + 1}/{repeats} done at {time.time() - started:.0f} s", file=sys.stderr,
              flush=True)


def by_file(cs: list[Contender]) -> list[list[Contender]]:
    """The contenders grouped by the file they use, each saver first: a group runs together and its file is
    removed after it, so the disk never holds more than one checkpoint of the bench (a grid of 4 GiB files
    would need tens of GB)."""
    groups: dict[str, list[Contender]] = {}
    for c in cs:
        groups.setdefault(c.kind, []).append(c)
    return [sorted(g, key=lambda c: 0 if c.save is not None else 1) for g in groups.values()]


def rates(nbytes: int, seconds: list[float]) -> list[float]:
    """GB/s of each sample, sorted."""
    return sorted(nbytes / s / 1e9 for s in seconds)


def cell(nbytes: int, seconds: list[float]) -> str:
    """GB/s as median (min-max)."""
    if not seconds:
        return "—"
    r = rates(nbytes, seconds)
    return f"{statistics.median(r):.2f} ({r[0]:.2f}–{r[-1]:.2f})"


def median_rate(nbytes: int, seconds: list[float]) -> float:
    """Median GB/s (0 when not measured)."""
    return statistics.median(rates(nbytes, seconds)) if seconds else 0.0


def cpu_cell(nbytes: int, cpu: list[float]) -> str:
    """Median CPU seconds per GB."""
    return f"{statistics.median(cpu) / (nbytes / 1e9):.2f}" if cpu else "—"


def mib_cell(values: list[float]) -> str:
    """Median bytes, in MiB."""
    return f"{statistics.median(values) / 2**20:.0f} MiB" if values else "—"


def report(label: str, nbytes: int, count: int, cs: list[Contender], repeats: int,
           pilot: int) -> tuple[list[str], dict]:
    """The tables and ratios for one state dict, and the ratios as a record."""
    grid = [c for c in cs if c.group == "grid"]
    candidates = {op: [c for c in cs if c.group == "bound" and op in c.bound_for] for op in ("save", "load")}
    bounds = {op: max(found, key=lambda c: median_rate(nbytes, c.samples[op]))
              for op, found in candidates.items()}
    lines = [f"### {label}: {nbytes / 1e9:.2f} GB in {count} tensors, {repeats} repeats", "",
             "| contender | save GB/s | save CPU s/GB | load GB/s (cold) | load CPU s/GB | peak extra RSS: "
             "save / load (the loaded state included) |", "| --- | --- | --- | --- | --- | --- |"]
    for c in [c for c in cs if c.group == "main"] + [c for c in cs if c.group == "reference"]:
        lines.append(f"| {c.name} | {cell(nbytes, c.samples['save'])} | "
                     f"{cpu_cell(nbytes, c.samples['save_cpu'])} | {cell(nbytes, c.samples['load'])} | "
                     f"{cpu_cell(nbytes, c.samples['load_cpu'])} | "
                     f"{mib_cell(c.samples['save_rss'])} / {mib_cell(c.samples['load_rss'])} |")
    w, r = bounds["save"], bounds["load"]
    lines.append(f"| **bound**: one raw transfer of the file's bytes, locked buffer, the best of the pilot's "
                 f"{CANDIDATES} best grid points measured again (write: {w.name[len('bound raw '):]}; read: "
                 f"{r.name[len('bound raw '):]}) | {cell(nbytes, w.samples['save'])} | "
                 f"{cpu_cell(nbytes, w.samples['save_cpu'])} | {cell(nbytes, r.samples['load'])} | "
                 f"{cpu_cell(nbytes, r.samples['load_cpu'])} | — |")
    pilot_of = {f"bound {c.name}": c for c in grid}

    def both(c: Contender, op: str) -> str:
        if op not in c.bound_for:
            return "—"
        return (f"{median_rate(nbytes, pilot_of[c.name].samples[op]):.2f} → "
                f"{median_rate(nbytes, c.samples[op]):.2f}")

    lines += ["", f"The bound's candidates: each operation's {CANDIDATES} best grid points in the pilot "
              f"({pilot} repeats of the grid before the run), measured again in the run, interleaved with "
              "the contenders; the best run median is the bound. Medians, pilot → run:", "",
              "| setting | write GB/s | read GB/s |", "| --- | --- | --- |"]
    lines += [f"| {c.name[len('bound raw '):]} | {both(c, 'save')} | {both(c, 'load')} |"
              for c in cs if c.group == "bound"]
    lines += ["", "The pilot's grid (one sync_pwrite + fsync / one sync_pread of the file's bytes), medians:",
              "",
              "| setting | write GB/s | read GB/s |", "| --- | --- | --- |"]
    lines += [f"| {c.name[4:]} | {median_rate(nbytes, c.samples['save']):.2f} | "
              f"{median_rate(nbytes, c.samples['load']):.2f} |" for c in grid]
    by = {c.kind: c for c in cs if c.group == "main"}
    by["bound-save"], by["bound-load"] = w, r
    fresh = [c for c in cs if c.name.startswith("raw read into fresh") and c.samples["load"]]
    if fresh:
        by["fresh"] = max(fresh, key=lambda c: median_rate(nbytes, c.samples["load"]))
    for c in cs:
        if c.name == MADE_BEFORE:
            by["deepnvme-made-before"] = c
        elif c.name == DIRECT:
            by["deepnvme-direct"] = c
        elif c.name == ZEROED:
            by["deepnvme-zeroed"] = c
    made = [c for c in cs if c.name in (MEMORY_ONLY, MEMORY_ONLY_HUGE) and c.samples["load"]]
    if made:
        by["memory-only"] = max(made, key=lambda c: median_rate(nbytes, c.samples["load"]))
    atomic = [c for c in cs if c.kind == "raw-atomic"]
    if atomic:
        by["raw-atomic"] = atomic[0]
    found: dict[str, float] = {}

    def ratio(kind: str, base: str, op: str, target: float | None, what: str) -> str | None:
        """Ratio of medians, and the median of the per-repeat ratios (each repeat's two samples were taken
        minutes apart at most, so this one is less exposed to a load that drifts over the run)."""
        a, b = by.get(kind), by.get(base)
        if a is None or b is None or not a.samples[op] or not b.samples[op]:
            return None
        value = median_rate(nbytes, a.samples[op]) / median_rate(nbytes, b.samples[op])
        paired = statistics.median(y / x for x, y in zip(a.samples[op], b.samples[op]))
        found[what] = round(value, 3)
        verdict = "" if target is None else f"; target ≥ {target}×: {'met' if value >= target else 'NOT met'}"
        return f"- {what}: {value:.2f}× (per-repeat {paired:.2f}×{verdict})"

    rows = [ratio("deepnvme", "bound-save", "save", 0.9, "deepnvme.save / bound write"),
            ratio("deepnvme", "bound-load", "load", 0.9, "deepnvme.load / bound read"),
            ratio("dcp-aio", "bound-save", "save", 0.85, "AioStorageWriter 1 proc / bound write"),
            ratio("dcp-aio", "bound-load", "load", 0.85, "AioStorageReader 1 proc / bound read"),
            ratio("raw-atomic", "bound-save", "save", None, "raw write committed atomically / bound write"),
            ratio("deepnvme", "raw-atomic", "save", None, "deepnvme.save / raw write committed atomically"),
            ratio("fresh", "bound-load", "load", None,
                  "best raw read into fresh memory (zeroed O_DIRECT, zeroed staged, or filled) / bound read"),
            ratio("deepnvme", "fresh", "load", None, "deepnvme.load / best raw read into fresh memory"),
            ratio("memory-only", "bound-load", "load", None,
                  "new memory made alone, nothing read (the faster page size) / bound read: a ceiling here "
                  "for a load into new memory the kernel zeroes"),
            ratio("deepnvme", "memory-only", "load", None, "deepnvme.load / new memory made alone"),
            ratio("deepnvme", "deepnvme-zeroed", "load", None,
                  "deepnvme.load / deepnvme.load into new memory zeroed by the kernel first"),
            ratio("deepnvme-made-before", "bound-load", "load", None,
                  "deepnvme.load into memory made before the clock / bound read"),
            ratio("deepnvme", "deepnvme-made-before", "load", None,
                  "deepnvme.load / deepnvme.load into memory made before the clock"),
            ratio("deepnvme-direct", "deepnvme", "load", None,
                  "deepnvme.load with payloads read O_DIRECT into place / deepnvme.load"),
            ratio("deepnvme", "torch", "save", None, "deepnvme.save / torch.save + fsync"),
            ratio("deepnvme", "torch", "load", None, "deepnvme.load / cold torch.load"),
            ratio("dcp-aio", "dcp-fs", "save", None, "AioStorageWriter / FileSystemWriter"),
            ratio("dcp-aio", "dcp-fs", "load", None, "AioStorageReader / FileSystemReader")]
    lines += ["", "Ratios of medians:", *(row for row in rows if row is not None), ""]
    return lines, found


FRESH_NOTE = (f"glibc's mmap threshold fixed at {MMAP_THRESHOLD >> 10} KiB and freed memory trimmed before "
              "each operation: every load's large allocations are new memory")
NOT_FRESH_NOTE = "NO fixed mmap threshold (not glibc?): a load may reuse memory that earlier ones freed"


def main(argv: list[str] | None = None) -> int:
    """Run every contender over both state dicts, interleaved, and write the tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=str(ROOT / "_bench_out" / "ckpt"), help="where checkpoints are written")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pilot", type=int, default=2,
                    help="repeats of the settings grid that pick the bound's setting, before the run")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="GPT-2-small-like (~0.5 GB) and 1 GiB state dicts")
    size.add_argument("--quick", action="store_true", help="the GPT-2-medium-like state dict only")
    ap.add_argument("--all", action="store_true",
                    help="also torch.load(mmap), safetensors, DCP FileSystemWriter/Reader, DCP in 2 ranks")
    ap.add_argument("--rest", type=float, default=0.5, help="seconds of rest before each timed operation")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ckpt"),
                    help="output prefix (.md, .json)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.pilot < 1 or args.rest < 0:
        ap.error("--repeats and --pilot must be >= 1 and --rest >= 0")
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    # Every load makes its tensors in new memory, as the first load of a process does, whatever loads ran
    # before it in this one.
    fresh = large_allocations_new()

    from deepnvme._core.handles import checkpoint_settings

    settings, source = checkpoint_settings(workdir)
    if args.small:
        dicts = [("GPT-2-small-like", gpt2_shapes(12, 768)), ("1 GiB, 4 x 256 MiB", big_shapes(GIB))]
    elif args.quick:
        dicts = [("GPT-2-medium-like", gpt2_shapes(24, 1024))]
    else:
        dicts = [("GPT-2-medium-like", gpt2_shapes(24, 1024)), ("4 GiB, 16 x 256 MiB", big_shapes(4 * GIB))]
    pool = RankPool() if args.all else None
    started = time.time()
    lines: list[str] = []
    record: dict[str, Any] = {"argv": sys.argv, "checkpoint_handle": settings, "results": {}}
    engine = "?"
    try:
        for label, shapes in dicts:
            load_before = os.getloadavg()
            sd = make_state(shapes)
            nbytes = nbytes_of(shapes)
            locked = LockedBytes(sd, workdir)
            engine = locked.handle.get_engine()
            try:
                grid = raw_grid(locked)
                run_repeats(grid, args.pilot, f"{label}, pilot", sd, shapes, workdir, args.rest, pool,
                            started)
                cs = contenders(pool, args.all) + raw_references(locked) + confirmed_bounds(grid, nbytes)
                run_repeats(cs, args.repeats, label, sd, shapes, workdir, args.rest, pool, started)
                cs += grid
            finally:
                locked.free()
            table, ratios = report(label, nbytes, len(shapes), cs, args.repeats, args.pilot)
            loads = [round(x, 1) for x in (*load_before, *os.getloadavg())]
            table[2:2] = [f"Load average (1, 5, 15 min) before: {loads[:3]}, after: {loads[3:]}.", ""]
            lines += table
            record["results"][label] = {"bytes": nbytes, "file_bytes": locked.nbytes, "tensors": len(shapes),
                                        "repeats": args.repeats, "pilot_repeats": args.pilot,
                                        "ratios": ratios, "load_average_before_after": loads,
                                        "contenders": contenders_record(cs)}
            del sd
    finally:
        if pool is not None:
            pool.close()
    head = [f"Command: `python3 bench/ckpt_bench.py {' '.join(sys.argv[1:])}`", "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}, torch "
            f"{torch.__version__}; checkpoints in {workdir} "
            f"(O_DIRECT {'works' if o_direct_works(str(workdir)) else 'refused'}); checkpoint handle "
            f"{settings} ({source}, engine {engine}); "
            f"{FRESH_NOTE if fresh else NOT_FRESH_NOTE}; "
            f"run took {time.time() - started:.0f} s. GB/s are state-dict bytes (10^9) per second.", ""]
    record["seconds"] = round(time.time() - started, 1)
    text = "\n".join(head + lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(text + "\n")
    Path(args.out + ".json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
