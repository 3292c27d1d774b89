"""ds_nvme_tune: find the aio_handle settings that reach a drive's speed, within a time budget, without sudo.

The search is coarse to fine: starting from DeepSpeed's usual settings it sweeps one setting at a time
(engine, block size, queue depth, threads, overlap_events, single_submit) over widely spaced values,
keeps each winner, repeats while a pass still gains more than 3%, then tries the neighbours of the
winning block size and queue depth, and finally re-measures the best few to guard against noise. A
configuration far behind the leader after its first loop is not measured further (early stopping).
Small spaces (--sweep_config with 12 or fewer points) are measured exhaustively.

Reads bypass the page cache with O_DIRECT, or drop the file's pages with fdatasync + POSIX_FADV_DONTNEED
where O_DIRECT is refused, so --flush_page_cache needs no sudo (it is accepted and always on).
GB = 1024^3 bytes, as ds_io.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from deepnvme.pagecache import DESCRIPTIONS, O_DIRECT, drop_file_cache, read_mode
from deepnvme.sizes import format_size, parse_size

GB = 1024**3
KEYS = ("block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism", "engine")
START = {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False, "overlap_events": True,
         "intra_op_parallelism": 1, "engine": "auto"}
COARSE = {"block_size": [256 << 10, 1 << 20, 4 << 20], "queue_depth": [8, 32, 128],
          "intra_op_parallelism": [1, 2, 4, 8], "overlap_events": [True, False],
          "single_submit": [False, True]}
# DeepSpeed's sweep_config names, mapped to aio_handle's; sequential_requests is the inverse of overlap.
ALIASES = {"io_parallel": "intra_op_parallelism", "num_threads": "intra_op_parallelism"}
GAIN = 1.03  # a pass must beat the leader by this factor to count as progress
EXIT_USAGE = 2


class UsageError(Exception):
    """A bad command line; the message names the argument."""


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's ds_nvme_tune flags, plus --engine, --time_budget, --json."""
    p = argparse.ArgumentParser(prog="ds_nvme_tune", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="engines to search: auto (every available one), or a comma list of "
                        "io_uring, libaio, posix")
    p.add_argument("--time_budget", type=float, default=60.0, help="seconds for the search (default 60)")
    p.add_argument("--no_fio", action="store_true", help="skip the fio comparison run")
    p.add_argument("--json", action="store_true", help="print one JSON record on stdout at the end")
    return p


def _bool(value: Any, key: str) -> bool:
    """JSON booleans, or DeepSpeed's "true"/"false" strings, as bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise UsageError(f"argument --sweep_config: {key} value {value!r} is not a boolean")


def parse_sweep(text: str, engines: list[str]) -> dict[str, list]:
    """--sweep_config (file or inline JSON) -> {aio_handle key: [values]}; UsageError naming what is wrong."""
    try:
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                raw = json.load(f)
        else:
            raw = json.loads(text)
    except (OSError, ValueError) as exc:
        raise UsageError(f"argument --sweep_config: not a JSON file or JSON text ({exc})") from None
    if not isinstance(raw, dict):
        raise UsageError("argument --sweep_config: must be a JSON object of option -> list of values")
    space: dict[str, list] = {}
    for key, values in raw.items():
        if key == "folder_to_device_mapping":
            continue  # DeepSpeed puts the directories here; ours come from --nvme_dir
        values = values if isinstance(values, list) else [values]
        if not values:
            raise UsageError(f"argument --sweep_config: {key} has no values")
        name = ALIASES.get(key, key)
        try:
            if key == "sequential_requests":
                name, vals = "overlap_events", [not _bool(v, key) for v in values]
            elif name in ("single_submit", "overlap_events"):
                vals = [_bool(v, key) for v in values]
            elif name == "block_size":
                vals = [parse_size(v) for v in values]
            elif name in ("queue_depth", "intra_op_parallelism"):
                vals = [int(v) for v in values]
                if min(vals) < 1:
                    raise ValueError("must be at least 1")
            elif name == "engine":
                vals = [str(v) for v in values]
                bad = [v for v in vals if v not in engines]
                if bad:
                    raise ValueError(f"{bad} not available here (available: {engines})")
            else:
                raise UsageError(f"argument --sweep_config: unknown option {key!r} (use one of "
                                 f"{', '.join(KEYS)}, sequential_requests, io_parallel)")
        except (TypeError, ValueError) as exc:
            raise UsageError(f"argument --sweep_config: {key}: {exc}") from None
        space[name] = sorted(set(vals), key=vals.index)
    return space


class Bench:
    """Measures one configuration on every directory at once (one thread and buffer per directory)."""

    def __init__(self, aio: Any, dirs: list[str], io_size: int, loops: int, do_read: bool, do_write: bool,
                 device: Callable[[int], Any] | None = None) -> None:
        import torch

        self.aio, self.dirs, self.io_size, self.loops = aio, dirs, io_size, loops
        self.do_read, self.do_write = do_read, do_write
        self.paths = [os.path.join(d, f"_deepnvme_tune.{i}.bin") for i, d in enumerate(dirs)]
        self.modes = [read_mode(d) for d in dirs]
        self.owner = aio.aio_handle()
        example = torch.empty(0, dtype=torch.uint8)
        if device is not None:
            self.buffers = [torch.empty(io_size, dtype=torch.uint8, device=device(i))
                            for i in range(len(dirs))]
            self.locked = False
        else:
            self.buffers = [self.owner.new_cpu_locked_tensor(io_size, example) for _ in dirs]
            self.locked = True
        for b in self.buffers:
            b.fill_(0xA5)
        writer = aio.aio_handle(queue_depth=32, overlap_events=True, intra_op_parallelism=2)
        for b, p in zip(self.buffers, self.paths):
            writer.sync_pwrite(b, p)  # reads need a full file even when writes are not measured

    def _all(self, handles: list, op: str) -> float:
        """Seconds for every directory to finish one write or read of io_size, side by side."""
        if op == "read":
            for p, m in zip(self.paths, self.modes):
                if m != O_DIRECT:
                    drop_file_cache(p)
        errors: list[BaseException] = []

        def one(h: Any, b: Any, p: str) -> None:
            try:
                (h.sync_pread if op == "read" else h.sync_pwrite)(b, p)
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=a) for a in zip(handles, self.buffers, self.paths)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if errors:
            raise errors[0]
        return elapsed

    def measure(self, config: dict, floor: float = 0.0) -> dict:
        """GB/s for write and read (summed over directories); stops after one loop when below `floor`."""
        handles = [self.aio.aio_handle(**config) for _ in self.dirs]
        total = self.io_size * len(self.dirs)
        speeds: dict[str, list[float]] = {"write": [], "read": []}
        ops = [op for op, on in (("write", self.do_write), ("read", self.do_read)) if on]
        for loop in range(self.loops):
            for op in ops:
                speeds[op].append(total / self._all(handles, op) / GB)
            score = sum(max(v) for v in speeds.values() if v)
            if loop == 0 and floor and score < floor:
                break  # early stopping: far behind the leader, more loops will not change the choice
        result = {op: max(v) for op, v in speeds.items() if v}
        result["score"] = sum(result.get(op, 0.0) for op in ("write", "read"))
        result["engine"] = handles[0].get_engine()
        return result

    def close(self) -> None:
        """Free the buffers and remove the files."""
        if self.locked:
            for b in self.buffers:
                self.owner.free_cpu_locked_tensor(b)
        self.buffers = []
        for p in self.paths:
            if os.path.exists(p):
                os.unlink(p)


class Search:
    """Coarse-to-fine coordinate search with a time budget, a progress bar and a log."""

    def __init__(self, bench: Bench, space: dict[str, list], budget: float, log: Callable[[str], None],
                 exhaustive: bool, fine: dict[str, list] | None = None) -> None:
        self.bench, self.space, self.budget, self.log = bench, space, budget, log
        self.exhaustive = exhaustive
        self.fine = fine or {}  # values the fine stage may try around the coarse winners
        self.results: list[dict] = []  # every measurement, in order
        self.by_key: dict[str, list[dict]] = {}
        self.start = time.monotonic()
        self.bar = _progress(self._estimate())

    def _estimate(self) -> int:
        """Evaluations the plan expects (the bar's total; early stopping may finish sooner)."""
        if self.exhaustive:
            return _product(self.space) + 12
        return sum(len(v) for v in self.space.values()) * 2 + 16

    @staticmethod
    def key(config: dict) -> str:
        """A stable text key for a configuration."""
        return json.dumps(config, sort_keys=True)

    def left(self) -> float:
        """Seconds of budget left."""
        return self.budget - (time.monotonic() - self.start)

    def best(self, confirmed: bool = False) -> tuple[dict, dict] | None:
        """(config, median result) with the highest median score; `confirmed`: among re-measured ones."""
        pool = [k for k in self.by_key if len(self.by_key[k]) >= 2] if confirmed else list(self.by_key)
        if not pool:
            return None
        key = max(pool, key=lambda k: statistics.median(r["score"] for r in self.by_key[k]))
        runs = self.by_key[key]
        med = {m: statistics.median(r[m] for r in runs) for m in ("score", "write", "read") if m in runs[0]}
        return json.loads(key), med

    def score(self, config: dict, again: bool = False) -> float | None:
        """The config's median score, measuring it unless known (or `again`); None once over budget."""
        k = self.key(config)
        if k in self.by_key and not again:
            return statistics.median(r["score"] for r in self.by_key[k])
        mean_cost = (time.monotonic() - self.start) / max(len(self.results), 1)
        if self.results and self.left() < mean_cost:
            return None
        lead = self.best()
        floor = 0.7 * lead[1]["score"] if lead else 0.0
        result = self.bench.measure(config, floor)
        result["config"] = config
        result["t"] = round(time.monotonic() - self.start, 2)
        self.results.append(result)
        self.by_key.setdefault(k, []).append(result)
        parts = [f"{op} {result[op]:.3f}" for op in ("write", "read") if op in result]
        self.log(f"{describe(config)} -> {', '.join(parts)} GB/sec ({result['engine']})")
        self.bar.update(1)
        lead = self.best()
        self.bar.set_postfix_str(f"best {lead[1]['score']:.2f} GB/s")
        return result["score"]

    def run(self) -> tuple[dict, dict]:
        """Search, then return the best (config, median result)."""
        try:
            if self.exhaustive:
                self._grid()
            else:
                self._coordinate()
            self._confirm()
        finally:
            self.bar.close()
        # A single lucky sample must not beat configurations that held up when measured again.
        found = self.best(confirmed=True) or self.best()
        if found is None:
            raise RuntimeError("the time budget ran out before one configuration was measured")
        return found

    def _grid(self) -> None:
        """Every point of a small space."""
        keys = list(self.space)
        for values in itertools.product(*(self.space[k] for k in keys)):
            if self.score({**START, **dict(zip(keys, values))}) is None:
                return

    def _coordinate(self) -> None:
        """One setting at a time over coarse values; passes until no gain; then the winners' neighbours."""
        current = {k: (self.space[k][0] if k in self.space and START[k] not in self.space[k] else START[k])
                   for k in START}
        if self.score(current) is None:
            return
        for _ in range(3):
            before = self.score(current)
            for dim in ("engine", "block_size", "queue_depth", "intra_op_parallelism", "overlap_events",
                        "single_submit"):
                for value in self.space.get(dim, []):
                    if value == current[dim]:
                        continue
                    better = self._step(current, dim, value)
                    if better is None:
                        return
                    current = better
            if self.score(current) < before * GAIN:
                break  # early stopping: a whole pass gained less than 3%
        for dim in ("block_size", "queue_depth"):
            if dim not in self.fine:
                continue
            for value in (current[dim] // 2, current[dim] * 2):
                if value in self.fine[dim] and value != current[dim]:
                    better = self._step(current, dim, value)
                    if better is None:
                        return
                    current = better

    def _step(self, current: dict, dim: str, value: object) -> dict | None:
        """`current` with `dim` set to `value` if that scores clearly better, else `current`; None once the
        budget is spent."""
        trial = {**current, dim: value}
        s = self.score(trial)
        if s is None:
            return None
        return trial if s > self.score(current) * GAIN else current

    def _confirm(self, top: int = 4, rounds: int = 3) -> None:
        """Measure the leaders again, round by round, while the budget lasts: noise must not decide."""
        ranked = sorted(self.by_key, key=lambda k: -statistics.median(r["score"] for r in self.by_key[k]))
        for _ in range(rounds):
            for k in ranked[:top]:
                if self.score(json.loads(k), again=True) is None:
                    return


def _product(space: dict[str, list]) -> int:
    """Points in a space."""
    n = 1
    for v in space.values():
        n *= len(v)
    return n


class _NoBar:
    """Stands in for tqdm when it is not installed."""

    def update(self, n: int) -> None:
        """Nothing to draw."""

    def set_postfix_str(self, s: str) -> None:
        """Nothing to draw."""

    def close(self) -> None:
        """Nothing to close."""


def _progress(total: int) -> Any:
    """A tqdm bar on stderr, or nothing when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="tuning", unit="cfg", file=sys.stderr, leave=False, dynamic_ncols=True)


def describe(config: dict) -> str:
    """One line for a configuration, e.g. 'io_uring bs=1M qd=32 p=2 overlap single=no'."""
    return (f"{config['engine']} bs={format_size(config['block_size'])} qd={config['queue_depth']} "
            f"p={config['intra_op_parallelism']} {'overlap' if config['overlap_events'] else 'sequential'} "
            f"{'single' if config['single_submit'] else 'batch'}")


def deepspeed_section(config: dict, gds: bool) -> dict:
    """DeepSpeed's "aio" config section: its key names, JSON booleans, no engine (it has none)."""
    section = {k: config[k] for k in ("block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                                      "overlap_events")}
    if gds:
        section["use_gds"] = True
    return {"aio": section}


def run_fio(directory: str, config: dict, io_size: int, do_write: bool, do_read: bool) -> dict[str, float]:
    """fio once with the winning settings on the same directory; GB/s per operation (GB = 1024^3)."""
    engine = {"io_uring": "io_uring", "libaio": "libaio"}.get(config["engine"], "psync")
    jobs = config["intra_op_parallelism"]
    share = max(io_size // jobs // config["block_size"], 1) * config["block_size"]
    path = os.path.join(directory, "_deepnvme_tune_fio.bin")
    out: dict[str, float] = {}
    try:
        for op in [o for o, on in (("write", do_write), ("read", do_read)) if on]:
            args = ["fio", "--output-format=json", "--group_reporting", f"--name=tune_{op}",
                    f"--filename={path}", f"--rw={op}", f"--bs={config['block_size']}", "--direct=1",
                    f"--ioengine={engine}",
                    f"--iodepth={config['queue_depth']}", f"--numjobs={jobs}", f"--size={share}",
                    f"--offset_increment={share}"]
            proc = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr.strip() or proc.stdout.strip())
            text = proc.stdout
            job = json.loads(text[text.index("{"):])["jobs"][0]
            out[op] = job[op]["bw_bytes"] / GB
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


def _chart(results: list[dict], path: str) -> bool:
    """A PNG bar chart of GB/s per configuration when matplotlib is installed; True when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows: dict[str, dict] = {}
    for r in results:
        rows.setdefault(describe(r["config"]), r)  # the first measurement of each configuration
    ordered = sorted(rows.items(), key=lambda kv: kv[1]["score"])
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(ordered) + 1.5))
    names = [n for n, _ in ordered]
    left = [0.0] * len(ordered)
    for op in ("write", "read"):
        vals = [r.get(op, 0.0) for _, r in ordered]
        ax.barh(names, vals, left=left, label=op)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("GB/sec (1024^3), write + read")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Validate (exit 2), search within the budget, print the best config as JSON, compare with fio."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except UsageError as exc:
        print(f"ds_nvme_tune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _main(args: argparse.Namespace) -> int:
    """Everything after parsing; UsageError for bad arguments."""
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

    from deepnvme import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible():
        print(f"ds_nvme_tune: async_io cannot be built here: {builder.error_log or 'see ds_report'}",
              file=sys.stderr)
        return 1
    aio = builder.load()
    available = list(aio.available_engines())
    engines = available if args.engine == "auto" else [e.strip() for e in args.engine.split(",") if e.strip()]
    bad = [e for e in engines if e not in available]
    if bad or not engines:
        raise UsageError(f"argument --engine: {', '.join(bad) or args.engine!r} not available here "
                         f"(available: {', '.join(available)})")
    if args.sweep_config:
        space = parse_sweep(args.sweep_config, available)
        space.setdefault("engine", engines if args.engine != "auto" else [engines[0]])
        exhaustive = _product(space) <= 12
        fine: dict[str, list] = {}
    else:
        space = {"engine": engines, **COARSE}
        exhaustive = False
        fine = {"block_size": [128 << 10, 512 << 10, 2 << 20, 8 << 20], "queue_depth": [4, 16, 64, 256]}
        fine = {k: sorted(set(v) | set(COARSE[k])) for k, v in fine.items()}

    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, "tune.log")
    log_file = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in the finally below

    def log(line: str) -> None:
        log_file.write(line + "\n")
        log_file.flush()
        if args.verbose:
            print(line, file=sys.stderr, flush=True)

    out = sys.stderr if args.json else sys.stdout  # with --json, stdout carries only the record
    print(f"Running DeepNVMe performance tuning on {args.nvme_dir}", file=out)
    modes = {read_mode(d) for d in args.nvme_dir}
    log(f"io_size {format_size(io_size)} per directory, loops {args.loops}, budget {args.time_budget:g} s, "
        f"reads: {'; '.join(DESCRIPTIONS[m] for m in sorted(modes))}")
    bench = Bench(aio, args.nvme_dir, io_size, args.loops, not args.no_read, not args.no_write, device)
    try:
        search = Search(bench, space, args.time_budget, log, exhaustive, fine)
        config, med = search.run()
    finally:
        bench.close()
        elapsed = time.monotonic() - search.start if "search" in locals() else 0.0
    if config["engine"] == "auto":
        config["engine"] = search.by_key[Search.key(config)][0]["engine"]
    config = {k: config[k] for k in KEYS}  # aio_handle's positional order, engine last
    read_s = f"{med['read']:.2f}" if "read" in med else "n/a"
    write_s = f"{med['write']:.2f}" if "write" in med else "n/a"
    print(f"Best performance (GB/sec): read = {read_s}, write = {write_s}  "
          f"({len(search.results)} measurements in {elapsed:.1f} s)", file=out)
    print("Best configuration for aio_handle(**config):", file=out)
    print(json.dumps(config), file=out)
    print('As DeepSpeed\'s "aio" config section:', file=out)
    print(json.dumps(deepspeed_section(config, args.gds), indent=3), file=out)

    record: dict[str, Any] = {"config": config, "aio": deepspeed_section(config, args.gds)["aio"],
                              "read_gb_s": med.get("read"), "write_gb_s": med.get("write"),
                              "measurements": len(search.results), "seconds": round(elapsed, 2),
                              "io_size": io_size, "nvme_dir": args.nvme_dir}
    if not args.no_fio and shutil.which("fio"):
        try:
            fio = run_fio(args.nvme_dir[0], config, io_size, not args.no_write, not args.no_read)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"fio comparison failed: {exc}", file=out)
        else:
            one = len(args.nvme_dir)  # fio runs on the first directory only; compare per directory
            parts = [f"{op} {fio[op]:.2f} GB/sec (deepnvme/fio = {med[op] / one / fio[op]:.2f}x)"
                     for op in ("write", "read") if op in fio]
            print(f"fio with the same settings on {args.nvme_dir[0]}: " + ", ".join(parts), file=out)
            record["fio_gb_s"] = fio
    elif not args.no_fio:
        print("fio is not on PATH: no comparison with the drive's limit", file=out)

    with open(os.path.join(args.log_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump({**record, "results": search.results}, f, indent=1)
    with open(os.path.join(args.log_dir, "best_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    chart = os.path.join(args.log_dir, "chart.png")
    if _chart(search.results, chart):
        record["chart"] = chart
    log_file.close()
    print(f"Log and results in {args.log_dir}" + (" (with chart.png)" if "chart" in record else ""), file=out)
    if args.json:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
