"""ds_io: time tensor reads or writes on a drive with DeepSpeed's flags and result lines, without sudo.

Engines (--engine):
  aio_handle    aio_handle.pread/pwrite(async) + wait() on a locked tensor (DeepSpeed's default engine)
  aio_basic     the module functions aio_read/aio_write (one blocking call per loop); with --io_engine
                other than auto, the same call through a fresh handle on that engine
  torch_io      torch.save + fsync / torch.load on a plain file (what a user gets without deepnvme)
  torch_fastio  deepnvme.save / deepnvme.load through the aio_handle; with --torch_legacy_save, torch.save's
                non-zip stream through DeepSpeed's FastFileWriter in a --fast_io_size locked buffer (two
                halves, so the serialisation overlaps the I/O), fsynced on close

Result lines are DeepSpeed's (GB = 1024^3 bytes; latency = slowest process' mean over loops, bytes summed
over processes), followed by per-request latency percentiles (one request = one loop's I/O call through its
completion, in one process) and CPU use. Reads avoid the page cache without root: O_DIRECT where the file
system allows it, otherwise fdatasync + POSIX_FADV_DONTNEED before every read; the output says which.
Invalid arguments exit with status 2 and name the argument.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from deepnvme._core.memory import PAGE
from deepnvme.tools.cli import (
    EXIT_USAGE,
    GB,
    UsageError,
    engine_choices,
    fsync_path,
    human_out,
    size_arg,
    writer,
)
from deepnvme.tools.ownership import banner, identity
from deepnvme.tools.pagecache import CACHED, DESCRIPTIONS, FADVISE, O_DIRECT, drop_file_cache, read_mode
from deepnvme.tools.pattern import fill_pattern
from deepnvme.tools.resident import touch_pages
from deepnvme.tools.sizes import format_size

__all__ = ["ENGINES", "EXIT_USAGE", "GB", "IO_ENGINES", "SHARED_NAME", "UsageError", "build_parser", "main",
           "run_all", "summarise", "validate", "worker"]

SHARED_NAME = "ds_io"  # the console script DeepSpeed installs too

ENGINES = ("aio_handle", "aio_basic", "torch_io", "torch_fastio")
IO_ENGINES = engine_choices()


def build_parser(prog: str = SHARED_NAME) -> argparse.ArgumentParser:
    """DeepSpeed's ds_io flags, plus --io_engine and --json."""
    summary, details = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog=prog, description=f"{banner(prog, SHARED_NAME)}\n{summary}",
                                epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", default=None, help="folder for every process's files")
    p.add_argument("--folder_to_device_mapping", default=[], nargs="+",
                   help="folder:device_id items, one process each (instead of --folder)")
    p.add_argument("--io_size", type=size_arg, required=True,
                   help="bytes per process per loop (K/M/G suffix)")
    p.add_argument("--fast_io_size", type=size_arg, default=64 << 20,
                   help="locked buffer of the torch_fastio legacy writer, two halves (default 64M)")
    p.add_argument("--read", action="store_true", help="read test (default: write)")
    p.add_argument("--multi_process", type=int, default=1, help="processes when --folder is used")
    p.add_argument("--block_size", type=size_arg, default=1 << 20, help="handle block size (default 1M)")
    p.add_argument("--queue_depth", type=int, default=32, help="handle queue depth (default 32)")
    p.add_argument("--single_submit", action="store_true", help="submit blocks one at a time")
    p.add_argument("--sequential_requests", action="store_true",
                   help="overlap_events=False: wait for each batch before the next")
    p.add_argument("--validate", action="store_true", help="check the data (outside the timing for torch)")
    p.add_argument("--engine", default="aio_handle", help="one of " + ", ".join(ENGINES))
    p.add_argument("--io_engine", default="auto", help="deepnvme engine: " + ", ".join(IO_ENGINES))
    p.add_argument("--loops", type=int, default=3, help="measured loops (default 3)")
    p.add_argument("--io_parallel", type=int, default=None, help="intra_op_parallelism (default 1)")
    p.add_argument("--gpu", action="store_true", help="GPU buffers (needs CUDA)")
    p.add_argument("--use_gds", action="store_true", help="GPUDirect Storage (needs --gpu and cuFile)")
    p.add_argument("--slow_bounce_buffer", action="store_true",
                   help="accepted for compatibility: GPU tensors always go through the handle's staging pool")
    p.add_argument("--torch_legacy_save", action="store_true", help="torch engines: non-zip serialisation")
    p.add_argument("--use_accelerator_pin_memory", action="store_true",
                   help="buffers from torch's pin_memory (CUDA) instead of new_cpu_locked_tensor; "
                        "without CUDA, a plain tensor")
    p.add_argument("--warmup_loops", type=int, default=1, help="untimed loops first (default 1)")
    p.add_argument("--include_warmup_time", action="store_true", help="time the warm-up loops too")
    p.add_argument("--different_file_each_iteration", action="store_true", help="one file per loop")
    p.add_argument("--json", action="store_true",
                   help="print one JSON record on stdout (the readable lines go to stderr)")
    return p


def validate(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Check the arguments together; return [(folder, device id)] or raise UsageError listing each problem."""
    problems: list[str] = []
    mapping: list[tuple[str, int]] = []
    if args.folder is None and not args.folder_to_device_mapping:
        problems.append("argument --folder/--folder_to_device_mapping: one of them is required")
    if args.folder is not None and args.folder_to_device_mapping:
        problems.append("argument --folder: not allowed with --folder_to_device_mapping")
    if args.folder is not None:
        mapping = [(args.folder, i) for i in range(max(args.multi_process, 1))]
    for item in args.folder_to_device_mapping:
        folder, sep, dev = item.rpartition(":")
        if not sep or not folder:
            problems.append(f"argument --folder_to_device_mapping: {item!r} is not folder:device_id")
        elif not dev.isdigit():
            problems.append(f"argument --folder_to_device_mapping: device id {dev!r} in {item!r} is not a "
                            "non-negative integer")
        else:
            mapping.append((folder, int(dev)))
    for folder in sorted({f for f, _ in mapping}):
        which = "--folder" if args.folder is not None else "--folder_to_device_mapping"
        if not os.path.isdir(folder):
            problems.append(f"argument {which}: {folder!r} is not an existing directory")
        elif not os.access(folder, os.W_OK | os.X_OK):
            problems.append(f"argument {which}: {folder!r} is not writable")
    if args.engine not in ENGINES:
        problems.append(f"argument --engine: {args.engine!r} is not one of {', '.join(ENGINES)}")
    if args.io_engine not in IO_ENGINES:
        problems.append(f"argument --io_engine: {args.io_engine!r} is not one of {', '.join(IO_ENGINES)}")
    for name, low in (("multi_process", 1), ("queue_depth", 1), ("loops", 1), ("warmup_loops", 0)):
        if getattr(args, name) < low:
            problems.append(f"argument --{name}: must be at least {low}, got {getattr(args, name)}")
    if args.io_parallel is not None and args.io_parallel < 1:
        problems.append(f"argument --io_parallel: must be at least 1, got {args.io_parallel}")
    if args.engine == "torch_fastio" and args.torch_legacy_save and args.fast_io_size < 2 * PAGE:
        problems.append(f"argument --fast_io_size: the legacy writer needs two pages ({2 * PAGE}), "
                        f"got {args.fast_io_size}")
    if args.folder is None and args.multi_process != 1:
        problems.append("argument --multi_process: only with --folder (a mapping gives one process per item)")
    if args.use_gds and not args.gpu:
        problems.append("argument --use_gds: requires --gpu")
    if args.use_gds and args.engine != "aio_handle":
        problems.append("argument --use_gds: only with --engine aio_handle")
    if args.gpu:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            problems.append("argument --gpu: no CUDA device here (torch.cuda.is_available() is False; "
                            f"torch {torch.__version__})")
        else:
            problems += [f"argument --folder_to_device_mapping: device {d} >= CUDA device count {count}"
                         for _, d in mapping if d >= count]
    if args.use_gds and args.gpu and not problems:
        from op_builder import GDSBuilder

        if not GDSBuilder().is_compatible():
            problems.append("argument --use_gds: GPUDirect Storage (cuFile) is not available here")
    if not problems and args.io_engine != "auto" and args.engine != "torch_io":
        from deepnvme import AsyncIOBuilder

        status = AsyncIOBuilder().load().engine_status()
        if status.get(args.io_engine) != "ok":
            problems.append(f"argument --io_engine: {args.io_engine} is unavailable here: "
                            f"{status.get(args.io_engine, 'not built')}")
    if problems:
        raise UsageError(problems)
    return mapping


@dataclass
class WorkerResult:
    """What one process measured: per-loop task and end-to-end seconds, CPU seconds, facts for the report."""

    tid: int
    task: list[float]
    e2e: list[float]
    cpu: float
    engine: str
    page_cache: str
    error: str = ""


class _NoBarrier:
    """Stands in for a barrier when only one process runs."""

    def wait(self) -> None:
        """Nothing to wait for."""


def _file_names(args: argparse.Namespace, folder: str, tid: int) -> list[str]:
    """DeepSpeed's naming: <folder>/_aio_{read|write}_{size}.pt.{tid}_{loop or 0}; torch files apart."""
    kind = "read" if args.read else "write"
    prefix = "_aio" if args.engine in ("aio_handle", "aio_basic") else "_torch"
    count = args.warmup_loops + args.loops if args.different_file_each_iteration else 1
    return [os.path.join(folder, f"{prefix}_{kind}_{args.io_size}.pt.{tid}_{n}") for n in range(count)]


class _Job:
    """One process's engine: builds its buffer and handle, prepares the files, runs one loop on a file."""

    def __init__(self, args: argparse.Namespace, device: int) -> None:
        import torch

        self.args = args
        self.torch = torch
        self.aio = None
        self.handle = None
        self.locked = False
        if args.engine == "torch_io":
            self.engine_name = "torch"
        else:
            from deepnvme import AsyncIOBuilder

            self.aio = AsyncIOBuilder().load()
            settings = {"block_size": args.block_size, "queue_depth": args.queue_depth,
                        "single_submit": args.single_submit, "overlap_events": not args.sequential_requests,
                        "intra_op_parallelism": args.io_parallel or 1}
            if args.use_gds:
                from op_builder import GDSBuilder

                self.handle = GDSBuilder().load().gds_handle(*settings.values())
            else:
                self.handle = self.aio.aio_handle(**settings, engine=args.io_engine)
            self.engine_name = self.handle.get_engine() if hasattr(self.handle, "get_engine") else "gds"
        self.device = torch.device(f"cuda:{device}") if args.gpu else torch.device("cpu")
        self.buffer = self._buffer(args.io_size)
        fill_pattern(self.buffer)
        self.stream_buffer = None
        if args.engine == "torch_fastio" and not args.read and args.torch_legacy_save:
            # Locked once per process, as DeepSpeed's writer keeps its pinned buffer, not once per save.
            self.stream_buffer = self.handle.new_cpu_locked_tensor(args.fast_io_size,
                                                                   torch.empty(0, dtype=torch.uint8))
        self.expected = self.buffer.clone() if args.validate else None

    def _buffer(self, n: int) -> Any:
        """A locked CPU tensor (DeepSpeed's choice), a GPU tensor with --gpu, or torch-pinned/plain memory."""
        torch = self.torch
        if self.args.gpu:
            return torch.empty(n, dtype=torch.uint8, device=self.device)
        if self.args.use_accelerator_pin_memory:
            t = torch.empty(n, dtype=torch.uint8)
            return t.pin_memory() if torch.cuda.is_available() else t
        if self.handle is not None and self.args.engine == "aio_handle":
            self.locked = True
            return self.handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
        return torch.empty(n, dtype=torch.uint8)

    def prepare(self, paths: list[str]) -> None:
        """Reads: create each file once (kept for later runs) if missing or the wrong size. Writes: remove."""
        for path in paths:
            if not self.args.read:
                if os.path.exists(path):
                    os.unlink(path)
                continue
            if self.args.engine in ("torch_io", "torch_fastio"):
                if not os.path.exists(path) or not self._torch_file_ok(path):
                    self.torch.save(self.buffer.cpu(), path)
            elif not os.path.exists(path) or os.path.getsize(path) != self.args.io_size:
                maker = writer(self.aio)
                if os.path.exists(path):
                    os.unlink(path)
                maker.sync_pwrite(self.buffer, path)
            fsync_path(path)

    def _torch_file_ok(self, path: str) -> bool:
        """A torch read file made earlier holds one uint8 tensor of io_size bytes."""
        try:
            t = self.torch.load(path, mmap=True, weights_only=True)
        except Exception:  # a damaged or foreign file is simply made again
            return False
        torch = self.torch
        return isinstance(t, torch.Tensor) and t.numel() == self.args.io_size and t.dtype == torch.uint8

    def run(self, path: str) -> None:
        """One loop's I/O on `path`, through its completion."""
        a, torch = self.args, self.torch
        if a.engine == "aio_handle":
            if a.read:
                self.handle.pread(self.buffer, path, a.validate, True)
            else:
                self.handle.pwrite(self.buffer, path, a.validate, True)
            self.handle.wait()
        elif a.engine == "aio_basic" and a.io_engine == "auto":
            fn = self.aio.aio_read if a.read else self.aio.aio_write
            fn(self.buffer, path, a.block_size, a.queue_depth, a.single_submit, not a.sequential_requests,
               a.validate)
        elif a.engine == "aio_basic":
            # What aio_read/aio_write do (a fresh one-thread handle per call), on the engine asked for.
            h = self.aio.aio_handle(a.block_size, a.queue_depth, a.single_submit, not a.sequential_requests,
                                    1, engine=a.io_engine)
            (h.pread if a.read else h.pwrite)(self.buffer, path, a.validate, False)
        elif a.engine == "torch_io":
            if a.read:
                self.loaded = torch.load(path, map_location=self.device, weights_only=True)
            else:
                torch.save(self.buffer, path, _use_new_zipfile_serialization=not a.torch_legacy_save)
                fsync_path(path)
        elif a.read:  # torch_fastio
            from deepnvme.serialization import load

            self.loaded = load(path, handle=self.handle, map_location=self.device)
        elif a.torch_legacy_save:
            from deepnvme.io import FastFileWriter, FastFileWriterConfig

            with FastFileWriter(path, FastFileWriterConfig(self.handle, self.stream_buffer)) as out:
                torch.save(self.buffer, out, _use_new_zipfile_serialization=False)
        else:
            from deepnvme.serialization import save

            save(self.buffer, path, handle=self.handle)

    def check(self, path: str) -> None:
        """--validate for the torch engines (the aio engines validate inside the library)."""
        a, torch = self.args, self.torch
        if not a.validate or a.engine in ("aio_handle", "aio_basic"):
            return
        got = self.loaded if a.read else torch.load(path, weights_only=True)
        if not torch.equal(got.cpu(), self.expected.cpu()):
            raise RuntimeError(f"validation failed: {path} does not hold the expected data")

    def close(self) -> None:
        """Release locked memory."""
        if self.stream_buffer is not None:
            self.handle.free_cpu_locked_tensor(self.stream_buffer)
            self.stream_buffer = None
        if self.locked:
            self.handle.free_cpu_locked_tensor(self.buffer)
            self.locked = False


def _cpu() -> float:
    """User+system CPU seconds of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _page_cache_mode(args: argparse.Namespace, folder: str) -> str:
    """How this run's reads avoid the page cache (writes: O_DIRECT for aio engines, fsync for torch)."""
    mode = read_mode(folder)
    if args.engine == "torch_io" and mode == O_DIRECT:
        return FADVISE  # torch.load reads through the page cache; the file is evicted before each read
    return mode


def worker(args: argparse.Namespace, tid: int, folder: str, device: int, barrier: Any) -> WorkerResult:
    """Run the warm-up and measured loops of one process; never raises (errors travel in the result)."""
    mode = _page_cache_mode(args, folder)
    try:
        job = _Job(args, device)
    except Exception as exc:  # reported by the parent with the process id
        return WorkerResult(tid, [], [], 0.0, "?", mode, f"{type(exc).__name__}: {exc}")
    task, e2e, cpu = [], [], 0.0
    try:
        paths = _file_names(args, folder, tid)
        job.prepare(paths)
        total = args.warmup_loops + args.loops
        for n in range(total):
            path = paths[n if args.different_file_each_iteration else 0]
            if args.read and mode != O_DIRECT:
                drop_file_cache(path)
            touch_pages(job.buffer)  # resident before the clock (see deepnvme.tools.resident)
            barrier.wait()
            c0, t0 = _cpu(), time.perf_counter()
            job.run(path)
            t1 = time.perf_counter()
            c1 = _cpu()
            barrier.wait()
            t2 = time.perf_counter()
            job.check(path)
            if n >= args.warmup_loops or args.include_warmup_time:
                task.append(t1 - t0)
                e2e.append(t2 - t0)
                cpu += c1 - c0
        if not args.read:
            for path in paths:
                if os.path.exists(path):
                    os.unlink(path)
    except Exception as exc:
        return WorkerResult(tid, task, e2e, cpu, job.engine_name, mode, f"{type(exc).__name__}: {exc}")
    finally:
        job.close()
    return WorkerResult(tid, task, e2e, cpu, job.engine_name, mode)


def _child(args: argparse.Namespace, tid: int, folder: str, device: int, barrier: Any, queue: Any) -> None:
    """Entry point of a spawned process: run, then send the result home."""
    try:
        result = worker(args, tid, folder, device, barrier)
    except BaseException as exc:  # even a barrier failure must reach the parent
        result = WorkerResult(tid, [], [], 0.0, "?", CACHED, f"{type(exc).__name__}: {exc}")
    queue.put(asdict(result))


def run_all(args: argparse.Namespace, mapping: list[tuple[str, int]]) -> list[WorkerResult]:
    """One process in place, or one spawned process per mapping item with a shared barrier."""
    if len(mapping) == 1:
        return [worker(args, 0, mapping[0][0], mapping[0][1], _NoBarrier())]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(mapping), timeout=600)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(args, tid, folder, dev, barrier, queue), daemon=True)
             for tid, (folder, dev) in enumerate(mapping)]
    for proc in procs:
        proc.start()
    results = []
    for _ in procs:
        results.append(WorkerResult(**queue.get()))
    for proc in procs:
        proc.join()
    return sorted(results, key=lambda r: r.tid)


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; enough for a handful of loops and honest about it."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[k]


def summarise(args: argparse.Namespace, results: list[WorkerResult]) -> dict:
    """DeepSpeed's figures (latency = slowest process' mean, bytes summed) plus percentiles and CPU."""
    task_lat = max(statistics.mean(r.task) for r in results)
    e2e_lat = max(statistics.mean(r.e2e) for r in results)
    total = args.io_size * len(results)
    every = [t for r in results for t in r.task]
    cpu = sum(r.cpu for r in results)
    moved = total * len(results[0].task)
    wall = sum(results[0].e2e)  # the processes run side by side, so one of them spans the run
    return {
        "op": "read" if args.read else "write",
        "engine": args.engine,
        "io_engine": results[0].engine,
        "processes": len(results),
        "io_size": args.io_size,
        "loops": args.loops,
        "warmup_loops": args.warmup_loops,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "single_submit": args.single_submit,
        "overlap_events": not args.sequential_requests,
        "intra_op_parallelism": args.io_parallel or 1,
        "page_cache": results[0].page_cache,
        "task_latency_s": task_lat,
        "task_speed_gb_s": total / task_lat / GB,
        "e2e_latency_s": e2e_lat,
        "e2e_speed_gb_s": total / e2e_lat / GB,
        "request_latency_p50_s": _percentile(every, 50),
        "request_latency_p99_s": _percentile(every, 99),
        "requests": len(every),
        "cpu_seconds": cpu,
        "cpu_seconds_per_gib": cpu / (moved / GB),
        "cpu_percent_of_one_core": 100 * cpu / wall if wall > 0 else 0.0,
    }


def report(rec: dict, out: Any) -> None:
    """DeepSpeed's four result lines, then ours."""
    op = "Read" if rec["op"] == "read" else "Write"
    print(f"Task {op} Latency = {rec['task_latency_s']} sec", file=out)
    print(f"Task {op} Speed = {rec['task_speed_gb_s']} GB/sec", file=out)
    print(f"E2E {op} Latency = {rec['e2e_latency_s']} sec", file=out)
    print(f"E2E {op} Speed = {rec['e2e_speed_gb_s']} GB/sec", file=out)
    print(f"Request {op} Latency p50 = {rec['request_latency_p50_s']:.6f} sec, "
          f"p99 = {rec['request_latency_p99_s']:.6f} sec ({rec['requests']} requests of "
          f"{format_size(rec['io_size'])})", file=out)
    print(f"CPU = {rec['cpu_seconds']:.3f} sec ({rec['cpu_seconds_per_gib']:.3f} CPU-sec per GiB, "
          f"{rec['cpu_percent_of_one_core']:.0f}% of one core)", file=out)


def main(argv: list[str] | None = None, prog: str = SHARED_NAME) -> int:
    """Parse, validate (exit 2 on bad arguments), run, print DeepSpeed's lines or one JSON record; the first
    line says whose ds_io this is, and so does the record's "tool" field."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    out = human_out(args.json)
    print(banner(prog, SHARED_NAME), file=out)
    print("Testing DeepNVMe python frontend", file=out)
    try:
        mapping = validate(args)
    except UsageError as exc:
        print(f"Found {len(exc.problems)} validation errors", file=sys.stderr)
        for i, problem in enumerate(exc.problems, 1):
            print(f"{i}: {problem}", file=sys.stderr)
        print(f"see {prog} --help", file=sys.stderr)
        return EXIT_USAGE
    print("Successful validation of command line arguments", file=out)
    for i, (folder, dev) in enumerate(mapping):
        print(f"[{i}]: {'gpu' if args.gpu else 'process'} {dev} <----> {folder}", file=out)
    mode = _page_cache_mode(args, mapping[0][0])
    if args.read:
        print(f"Page cache: {DESCRIPTIONS[mode]}", file=out)
    elif args.engine in ("torch_io",):
        print("Page cache: writes go through it; fsync is inside the timing", file=out)
    else:
        print("Page cache: writes use O_DIRECT where the file system allows it", file=out)
    results = run_all(args, mapping)
    failed = [r for r in results if r.error]
    if failed:
        for r in failed:
            print(f"{prog}: process {r.tid} failed: {r.error}", file=sys.stderr)
        return 1
    rec = {**summarise(args, results), "tool": identity(prog, SHARED_NAME)}
    report(rec, out)
    if args.json:
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
