"""ds_nvme_tune: find the aio_handle settings that reach a drive's speed, within a time budget, without sudo.

The search is coarse to fine: starting from DeepSpeed's usual settings it sweeps one setting at a time
(engine, block size, queue depth, threads, overlap_events, single_submit) over widely spaced values,
keeps each winner, repeats while a pass still gains more than 3%, then tries the neighbours of the
winning block size and queue depth, and finally re-measures the best few to guard against noise. A
configuration far behind the leader after its first loop is not measured further (early stopping).
Small spaces (--sweep_config with 12 or fewer points) are measured exhaustively.

At the end fio runs at the winning settings (same block size, queue depth, jobs = threads, engine's fio twin)
on one file laid out once for both, interleaved with the winner's own runs; a deepnvme/fio ratio beyond
1.2x either way is printed with a warning that the two runs did not measure the same thing.

Reads bypass the page cache with O_DIRECT, or drop the file's pages with fdatasync + POSIX_FADV_DONTNEED
where O_DIRECT is refused, so --flush_page_cache needs no sudo (it is accepted and always on).
GB = 1024^3 bytes, as ds_io.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from deepnvme._core.aio_types import AioModule
from deepnvme.tools.cli import EXIT_USAGE, UsageError, human_out
from deepnvme.tools.ownership import banner, identity
from deepnvme.tools.pagecache import DESCRIPTIONS, read_mode
from deepnvme.tools.sizes import format_size, parse_size

from .bench import Bench
from .chart import MISSING, chart
from .fio import compare_with_fio, format_comparison, mismatch, run_fio
from .search import Search, best_line, describe
from .space import KEYS, Plan, deepspeed_section, parse_sweep, plan

__all__ = ["KEYS", "SHARED_NAME", "Bench", "Search", "UsageError", "build_parser", "deepspeed_section",
           "describe", "main", "parse_sweep", "run_fio"]

SHARED_NAME = "ds_nvme_tune"  # the console script DeepSpeed installs too


def build_parser(prog: str = SHARED_NAME) -> argparse.ArgumentParser:
    """DeepSpeed's ds_nvme_tune flags, plus --engine, --time_budget, --json."""
    summary, details = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog=prog, description=f"{banner(prog, SHARED_NAME)}\n{summary}",
                                epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme_dir", nargs="+", required=True, help="directories on the drives (device 0..n-1)")
    p.add_argument("--sweep_config", default=None,
                   help="JSON file (or inline JSON) of option -> list of values, e.g. "
                        '{"block_size": ["256K", "1M"], "queue_depth": [8, 32]}')
    p.add_argument("--no_read", action="store_true", help="do not measure reads")
    p.add_argument("--no_write", action="store_true", help="do not measure writes")
    p.add_argument("--io_size", default="400M", help="bytes per directory per loop (default 400M)")
    p.add_argument("--gpu", action="store_true", help="GPU buffers (needs CUDA)")
    p.add_argument("--gds", action="store_true", help="GPUDirect Storage (needs --gpu and cuFile)")
    p.add_argument("--flush_page_cache", action="store_true",
                   help="accepted for compatibility: reads always bypass or drop the page cache, no sudo")
    p.add_argument("--log_dir", default="_aio_bench_logs", help="log, results.json, chart.png go here")
    p.add_argument("--loops", type=int, default=1, help="measured loops per configuration (default 1)")
    p.add_argument("--verbose", action="store_true", help="print every measurement")
    p.add_argument("--engine", default="auto",
                   help="engines to search: auto (every available one), or a comma list of real engines")
    p.add_argument("--time_budget", type=float, default=60.0, help="seconds for the search (default 60)")
    p.add_argument("--no_fio", action="store_true",
                   help="skip the comparison with fio at the winning settings (same file, interleaved)")
    p.add_argument("--json", action="store_true", help="print one JSON record on stdout at the end")
    return p


def main(argv: list[str] | None = None, prog: str = SHARED_NAME) -> int:
    """Validate (exit 2), search within the budget, print the best config as JSON, compare with fio; the first
    line says whose tuner this is, and so does the record's "tool" field."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    print(banner(prog, SHARED_NAME), file=human_out(args.json), flush=True)
    try:
        return _main(args, prog)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


@dataclass
class _Checked:
    """The arguments that needed checking, in the form the run uses."""

    io_size: int
    device: Callable[[int], Any] | None


def _check_args(args: argparse.Namespace) -> _Checked:
    """UsageError naming the first bad argument; else the size and the GPU per directory (if any)."""
    for d in args.nvme_dir:
        if not os.path.isdir(d) or not os.access(d, os.W_OK | os.X_OK):
            raise UsageError(f"argument --nvme_dir: {d!r} is not a writable directory")
    try:
        io_size = parse_size(args.io_size)
    except ValueError as exc:
        raise UsageError(f"argument --io_size: {exc}") from None
    if args.loops < 1:
        raise UsageError(f"argument --loops: must be at least 1, got {args.loops}")
    if args.time_budget <= 0:
        raise UsageError(f"argument --time_budget: must be positive, got {args.time_budget}")
    if args.no_read and args.no_write:
        raise UsageError("argument --no_read: with --no_write there is nothing to measure")
    if args.gds and not args.gpu:
        raise UsageError("argument --gds: requires --gpu")
    device = None
    if args.gpu:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < len(args.nvme_dir):
            raise UsageError(f"argument --gpu: {count} CUDA device(s) here, {len(args.nvme_dir)} needed "
                             f"(torch {torch.__version__})")
        device = lambda i: torch.device(f"cuda:{i}")  # noqa: E731 - one GPU per directory, as DeepSpeed
    if args.gds:
        raise UsageError("argument --gds: tuning gds_handle is not supported yet; tune aio_handle with --gpu")
    return _Checked(io_size, device)


def _engines(args: argparse.Namespace, available: list[str]) -> list[str]:
    """The engines to search: every available one for auto, else the listed ones (all must be available)."""
    engines = available if args.engine == "auto" else [e.strip() for e in args.engine.split(",") if e.strip()]
    bad = [e for e in engines if e not in available]
    if bad or not engines:
        raise UsageError(f"argument --engine: {', '.join(bad) or args.engine!r} not available here "
                         f"(available: {', '.join(available)})")
    return engines


class _Log:
    """tune.log in the log folder; every line also on stderr with --verbose."""

    def __init__(self, log_dir: str, verbose: bool) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.file = open(os.path.join(log_dir, "tune.log"), "w", encoding="utf-8")  # noqa: SIM115
        self.verbose = verbose

    def __call__(self, line: str) -> None:
        self.file.write(line + "\n")
        self.file.flush()
        if self.verbose:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.file.close()


def _search(args: argparse.Namespace, aio: AioModule, checked: _Checked, todo: Plan, log: _Log,
            ) -> tuple[dict, dict, Search, float]:
    """Measure within the budget; (best config with a concrete engine, its medians, the search, seconds)."""
    modes = {read_mode(d) for d in args.nvme_dir}
    log(f"io_size {format_size(checked.io_size)} per directory, loops {args.loops}, budget "
        f"{args.time_budget:g} s, reads: {'; '.join(DESCRIPTIONS[m] for m in sorted(modes))}")
    bench = Bench(aio, args.nvme_dir, checked.io_size, args.loops, not args.no_read, not args.no_write,
                  checked.device)
    search = None
    try:
        search = Search(bench, todo.space, args.time_budget, log, todo.exhaustive, todo.fine)
        config, med = search.run()
    finally:
        bench.close()
        elapsed = time.monotonic() - search.start if search is not None else 0.0
    if config["engine"] == "auto":
        config["engine"] = search.by_key[Search.key(config)][0]["engine"]
    return {k: config[k] for k in KEYS}, med, search, elapsed  # aio_handle's positional order, engine last


def _print_best(config: dict, med: dict, measurements: int, elapsed: float, gds: bool, out: TextIO) -> None:
    """The winner, as aio_handle(**config) and as DeepSpeed's "aio" section."""
    print(f"Best performance {best_line(med)}  ({measurements} measurements in {elapsed:.1f} s)", file=out)
    print("Best configuration for aio_handle(**config):", file=out)
    print(json.dumps(config), file=out)
    print('As DeepSpeed\'s "aio" config section:', file=out)
    print(json.dumps(deepspeed_section(config, gds), indent=3), file=out)


def _compare_with_fio(args: argparse.Namespace, aio: AioModule, config: dict, io_size: int, record: dict,
                      out: TextIO) -> None:
    """The winning settings and fio at the same settings, on one file in the first directory, interleaved
    (see tune/fio.py for what makes the two runs the same); ratios, and a warning for a suspect one."""
    if args.no_fio:
        return
    if not shutil.which("fio"):
        print("fio is not on PATH: no comparison with the drive's limit", file=out)
        return
    ops = [op for op, on in (("write", not args.no_write), ("read", not args.no_read)) if on]
    try:
        result = compare_with_fio(aio, args.nvme_dir[0], config, io_size, ops)
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
        print(f"fio comparison failed: {exc}", file=out)
        return
    for line in format_comparison(args.nvme_dir[0], describe(config), result):
        print(line, file=out)
    record["fio_gb_s"] = {op: result[op]["fio"] for op in ops}
    record["fio_comparison"] = {op: {k: result[op][k] for k in ("deepnvme", "fio", "ratio")} for op in ops}
    record["fio_comparison"]["warnings"] = [op for op in ops if mismatch(result[op]["ratio"])]


def _write_results(log_dir: str, record: dict, search: Search, config: dict, out: TextIO) -> None:
    """results.json (every measurement), best_config.json and, with matplotlib, chart.png (without, a line on
    `out` says so and how to get it)."""
    with open(os.path.join(log_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump({**record, "results": search.results}, f, indent=1)
    with open(os.path.join(log_dir, "best_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    path = os.path.join(log_dir, "chart.png")
    if chart(search.results, path):
        record["chart"] = path
    else:
        print(MISSING, file=out)


def _main(args: argparse.Namespace, prog: str) -> int:
    """Everything after parsing; UsageError for bad arguments."""
    checked = _check_args(args)
    from deepnvme import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible():
        print(f"{prog}: async_io cannot be built here: {builder.error_log or 'see deepnvme report'}",
              file=sys.stderr)
        return 1
    aio = builder.load()
    available = list(aio.available_engines())
    todo = plan(args.sweep_config, _engines(args, available), available, args.engine)
    out = human_out(args.json)  # with --json, stdout carries only the record
    print(f"Running DeepNVMe performance tuning on {args.nvme_dir}", file=out)
    log = _Log(args.log_dir, args.verbose)
    try:
        config, med, search, elapsed = _search(args, aio, checked, todo, log)
        _print_best(config, med, len(search.results), elapsed, args.gds, out)
        record: dict[str, Any] = {"config": config, "aio": deepspeed_section(config, args.gds)["aio"],
                                  "read_gb_s": med.get("read"), "write_gb_s": med.get("write"),
                                  "measurements": len(search.results), "seconds": round(elapsed, 2),
                                  "io_size": checked.io_size, "nvme_dir": args.nvme_dir,
                                  "tool": identity(prog, SHARED_NAME)}
        _compare_with_fio(args, aio, config, checked.io_size, record, out)
        _write_results(args.log_dir, record, search, config, out)
    finally:
        log.close()
    print(f"Log and results in {args.log_dir}" + (" (with chart.png)" if "chart" in record else ""), file=out)
    if args.json:
        print(json.dumps(record))
    return 0
