"""fio beside the handle at the same settings: one command, one file layout, one rule for a suspect ratio.

bench/aio_bench.py and ds_nvme_tune both compare with fio through this module, so that the two comparisons
cannot drift apart. "The same settings" means (bench/results/fio_methodology.md has the measurements that
led to each rule):

- one file for every job: fio gets ``--filename`` with ``--numjobs=N``, ``--size=share`` and
  ``--offset_increment=share``, so job k covers ``[k*share, (k+1)*share)``, the contiguous slices the
  handle's N threads (``intra_op_parallelism=N``) cut from one tensor;
- the same block size (fio ``--bs``, the handle's ``block_size``), queue depth per job / per thread and
  submission: the handle (``single_submit=False``) hands every ready request to the kernel in one call, so
  fio gets ``--iodepth_batch_submit=<depth>`` (its default submits requests one call each);
- the same work per write: the handle writes the tensor as it is, so fio gets ``--scramble_buffers=0`` (by
  default it rewrites part of each buffer inside its clock, against deduplicating storage);
- the same layout: the file is written in full and fsynced before either contender touches it, and both
  overwrite it in place (no O_TRUNC; ``--fallocate=none``). A fallocated, never-written file reads back
  zeros without touching the disk and makes every first write convert extents: not what an overwritten
  checkpoint sees;
- O_DIRECT on both sides, the file's page cache dropped before every read, runs interleaved;
- I/O memory ready before the clock: the handle's tensor is allocated and its pages touched
  (deepnvme.tools.resident); fio's buffers are registered during its set-up with io_uring's
  ``--fixedbufs``. libaio has no such option, so fio's libaio reads pay their page faults inside the clock
  whenever a job's share is not much larger than bs x iodepth;
- the same memory: locked tensors are 2 MiB transparent huge pages, and fio runs with
  ``glibc.malloc.hugetlb=1`` so that its malloc'd buffers are too (fio's own huge-page options need reserved
  hugetlbfs pages). On 4 KiB pages a 1 MiB request can span more segments than a virtual disk takes at once;
- the same start for several jobs: the handle's threads exist before its clock starts and begin together,
  while fio sets each job up on its own and clocks each from the end of its own set-up, so its group figure
  can assume side by side jobs that ran one after the other. run_fio_command holds every job at a barrier
  after its set-up (``--exec_prerun``) and times the run from the first request any job issued to the last
  one completed, from fio's per-request latency log, as the handle is timed; fio's own figure is kept.

fio's time leaves out its file open and process start; the handle's timing includes its open.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from deepnvme._core.aio_types import AioModule
from deepnvme._core.memory import PAGE
from deepnvme.tools.cli import GB
from deepnvme.tools.pagecache import drop_file_cache
from deepnvme.tools.resident import touch_pages
from op_builder.engines import by_name

__all__ = ["MISMATCH", "MISMATCH_CAUSES", "FioRun", "compare_with_fio", "fio_command", "fio_shares",
           "format_comparison", "lay_out", "layout_of", "mismatch", "mismatch_warning", "run_fio",
           "run_fio_command"]

#: handle/fio ratios beyond this factor either way mean the two runs did not measure the same thing
MISMATCH = 1.2
#: fio shares are cut at this granularity (O_DIRECT needs aligned offsets and sizes)
ALIGN = PAGE


def fio_shares(total: int, jobs: int, block: int) -> tuple[int, int]:
    """(bytes per job, fio block size) for `jobs` contiguous shares of `total` bytes.

    A share is whole blocks when it holds at least one; below that the share itself is the block, which is
    what the handle does with a slice shorter than its block size. ValueError when a job would get nothing.
    """
    if jobs < 1 or block < 1:
        raise ValueError(f"jobs and block must be positive, got jobs={jobs} block={block}")
    share = total // jobs // ALIGN * ALIGN
    if share == 0:
        raise ValueError(f"total {total} bytes gives each of {jobs} jobs less than {ALIGN} bytes")
    if share >= block:
        return share // block * block, block
    return share, share


def fio_command(path: str, op: str, engine: str, block: int, depth: int, jobs: int, total: int) -> list[str]:
    """The fio command for one sequential `op` ("write" or "read") of `total` bytes of `path`.

    `engine` is fio's --ioengine (the catalogue's fio twin of the handle's engine); io_uring gets
    --fixedbufs (see the module's docstring). Bytes moved are ``jobs * fio_shares(total, jobs, block)[0]``:
    give the handle a tensor of that size.
    """
    if op not in ("write", "read"):
        raise ValueError(f"op must be 'write' or 'read', got {op!r}")
    share, bs = fio_shares(total, jobs, block)
    return ["fio", "--output-format=json", "--group_reporting", f"--name=seq_{op}", f"--filename={path}",
            f"--rw={op}", f"--bs={bs}", "--direct=1", f"--ioengine={engine}", f"--iodepth={depth}",
            f"--iodepth_batch_submit={depth}", f"--numjobs={jobs}", f"--size={share}",
            f"--offset_increment={share}", "--fallocate=none", "--scramble_buffers=0",
            *(["--fixedbufs"] if engine == "io_uring" else [])]


@dataclass
class FioRun:
    """One fio run: seconds from its first request issued to its last completed (start-up excluded),
    CPU-seconds of fio and its jobs from their rusage (start-up included), and the CPU-seconds fio itself
    reports for the transfer."""

    seconds: float  # from the first request issued to the last completed, over all jobs (module docstring)
    nbytes: int
    cpu: float
    cpu_reported: float
    fixedbufs: bool = False  # whether fio ran with --fixedbufs (registered, pre-faulted buffers)
    fio_seconds: float = 0.0  # fio's own figure: bytes / group bandwidth (the longest job's own clock)


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _option(cmd: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}="))


def fio_environment() -> dict[str, str]:
    """This process's environment plus glibc's tunable for transparent huge pages in malloc (fio's buffers
    then sit on the same kind of pages as the handle's locked tensors: see the module's docstring)."""
    env = dict(os.environ)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    env["GLIBC_TUNABLES"] = ":".join([*tunables, "glibc.malloc.hugetlb=1"])
    return env


def run_fio_command(cmd: list[str], timeout: float = 300) -> FioRun:
    """Run a command from fio_command; RuntimeError with fio's message when it fails. ValueError naming the
    file when it is missing or shorter than the jobs need: fio would then lay it out its own way."""
    path = _option(cmd, "filename")
    need = int(_option(cmd, "size")) * int(_option(cmd, "numjobs"))
    have = os.stat(path).st_size if os.path.isfile(path) else -1
    if have < need:
        raise ValueError(f"{path}: {'missing' if have < 0 else f'{have} bytes'}, but fio's jobs need {need} "
                         "bytes laid out (lay_out) first, or fio would lay the file out its own way")
    with tempfile.TemporaryDirectory(prefix="deepnvme_fio_") as logs:
        # One line per request: completion time (absolute, ms) and latency (ns); see _span_seconds.
        logged = [*cmd, f"--write_lat_log={os.path.join(logs, 'req')}", "--log_unix_epoch=1",
                  "--log_avg_msec=0"]
        jobs = int(_option(cmd, "numjobs"))
        if jobs > 1:
            logged.append(f"--exec_prerun={_barrier(os.path.join(logs, 'barrier'), jobs)}")
        c0 = _children_cpu()
        proc = subprocess.run(logged, capture_output=True, text=True, timeout=timeout, check=False,
                              env=fio_environment(), cwd=logs)  # fio writes <job>.prerun.txt to its cwd
        cpu = _children_cpu() - c0
        if proc.returncode != 0 and "--fixedbufs" in cmd:
            # Registering fio's buffers pins them: without CAP_IPC_LOCK that needs RLIMIT_MEMLOCK >= bs x
            # iodepth. fio then runs without, and FioRun.fixedbufs tells the caller its reads paid first-touch
            # faults.
            return run_fio_command([a for a in cmd if a != "--fixedbufs"], timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        span = _span_seconds(logs)
    text = proc.stdout
    job = json.loads(text[text.index("{"):])["jobs"][0]
    op = "write" if "--rw=write" in cmd else "read"
    nbytes, bw = job[op]["io_bytes"], job[op]["bw_bytes"]
    if not bw:
        raise RuntimeError(f"{' '.join(cmd)} moved no data: {text[-500:]}")
    own = nbytes / bw
    # usr_cpu/sys_cpu are percentages of the job runtime, per job; group_reporting sums the jobs.
    reported = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job.get("job_runtime", own * 1000) / 1000
    # Never shorter than fio's own figure: the log's millisecond timestamps only ever lengthen a run whose
    # jobs did not overlap.
    return FioRun(max(own, span), nbytes, cpu, reported, "--fixedbufs" in cmd, own)


def _barrier(directory: str, jobs: int) -> str:
    """A shell command each of `jobs` fio jobs runs after its set-up: it checks in and waits until all have
    (at most about a minute, so that a job that died in set-up cannot hang the others)."""
    os.makedirs(directory, exist_ok=True)
    d = shlex.quote(directory)
    return (f"mktemp -p {d} >/dev/null; i=0; while [ $(ls -A {d} | wc -l) -lt {jobs} ] && "
            "[ $i -lt 60000 ]; do sleep 0.001; i=$((i+1)); done")


def _span_seconds(log_dir: str) -> float:
    """Seconds from the first request any job issued to the last one completed, from fio's latency logs
    (``<prefix>_lat.<job>.log``: completion time in ms since the epoch, then latency in ns); 0.0 when fio
    wrote none. Each end is known to within the log's 1 ms resolution."""
    first, last = float("inf"), float("-inf")
    for name in os.listdir(log_dir):
        if "_lat." not in name:  # the _clat and _slat logs split the same requests differently
            continue
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                fields = line.split(",")
                if len(fields) < 2:
                    continue
                done_ms = int(fields[0])
                first = min(first, done_ms - int(fields[1]) / 1e6)
                last = max(last, done_ms)
    return (last - first) / 1000 if last > first else 0.0


def lay_out(path: str, size: int) -> None:
    """Write `size` bytes of non-zero data to `path`, fsync it and evict it: the one layout both contenders
    overwrite in place (reads of it do real I/O, writes allocate nothing)."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    drop_file_cache(path)


def layout_of(path: str) -> tuple[int, int]:
    """(size, allocated 512-byte blocks): changes when a run re-lays the file out."""
    st = os.stat(path)
    return st.st_size, st.st_blocks


def mismatch(ratio: float) -> bool:
    """True when a handle/fio ratio at the same settings is beyond MISMATCH either way."""
    return ratio > MISMATCH or ratio < 1 / MISMATCH


def mismatch_warning(what: str, ratio: float) -> str | None:
    """The warning for a suspect handle/fio ratio at the same settings, or None when it is within bounds
    (print MISMATCH_CAUSES once beside any)."""
    if not mismatch(ratio):
        return None
    return (f"WARNING: {what}: deepnvme/fio = {ratio:.2f}x at the same settings, beyond {MISMATCH:g}x either "
            "way: the two runs did not measure the same thing")


#: what to check when mismatch_warning fires
MISMATCH_CAUSES = ("(a ratio that far from 1 at the same settings points at the measurement, not the "
                   "software: file layout, jobs per file, page cache, another load at the time, the "
                   "memory under each (fio's buffers are huge pages only where glibc honours "
                   "glibc.malloc.hugetlb, and with libaio fio's reads touch their buffers first inside its "
                   "clock), or the other side being faster; at small sizes also the handle's timed open and "
                   "thread start, which fio's figure leaves out)")


def run_fio(directory: str, config: dict, io_size: int, do_write: bool, do_read: bool) -> dict[str, float]:
    """fio alone with a handle's settings on a laid-out file in `directory`; GB/s per operation (GB =
    1024^3). compare_with_fio measures the handle beside it."""
    engine = by_name(config["engine"]).fio
    path = os.path.join(directory, "_deepnvme_tune_fio.bin")
    share, _ = fio_shares(io_size, config["intra_op_parallelism"], config["block_size"])
    total = share * config["intra_op_parallelism"]
    out: dict[str, float] = {}
    try:
        lay_out(path, total)
        for op in [o for o, on in (("write", do_write), ("read", do_read)) if on]:
            drop_file_cache(path)
            run = run_fio_command(fio_command(path, op, engine, config["block_size"], config["queue_depth"],
                                              config["intra_op_parallelism"], total))
            out[op] = run.nbytes / run.seconds / GB
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


def compare_with_fio(aio: AioModule, directory: str, config: dict, io_size: int, ops: list[str],
                     repeats: int = 3) -> dict[str, dict]:
    """The handle with `config` and fio at the same settings on one laid-out file, `repeats` interleaved
    rounds whose order alternates; per op the medians in GB/s (GB = 1024^3), their ratio, every sample,
    and whether the file's layout stayed as laid out."""
    import torch

    engine = by_name(config["engine"]).fio
    jobs, block = config["intra_op_parallelism"], config["block_size"]
    share, _ = fio_shares(io_size, jobs, block)
    total = share * jobs
    path = os.path.join(directory, "_deepnvme_tune_fio.bin")
    owner = aio.aio_handle()
    buf = owner.new_cpu_locked_tensor(total, torch.empty(0, dtype=torch.uint8))
    buf.fill_(0x5A)
    handle = aio.aio_handle(**config)
    samples: dict[str, dict[str, list[float]]] = {op: {"deepnvme": [], "fio": []} for op in ops}
    try:
        lay_out(path, total)
        laid = layout_of(path)

        def deepnvme(op: str) -> float:
            touch_pages(buf)  # resident before the clock, as fio's buffers are (deepnvme.tools.resident)
            start = time.perf_counter()
            (handle.sync_pread if op == "read" else handle.sync_pwrite)(buf, path)
            return time.perf_counter() - start

        def fio(op: str) -> float:
            run = run_fio_command(fio_command(path, op, engine, block, config["queue_depth"], jobs, total))
            return run.seconds

        contenders: list[tuple[str, Callable[[str], float]]] = [("deepnvme", deepnvme), ("fio", fio)]
        for r in range(repeats):
            for op in ops:
                for name, fn in (contenders if r % 2 == 0 else contenders[::-1]):
                    if op == "read":
                        drop_file_cache(path)
                    samples[op][name].append(total / fn(op) / GB)
        same_layout = layout_of(path) == laid
    finally:
        owner.free_cpu_locked_tensor(buf)
        if os.path.exists(path):
            os.unlink(path)
    result: dict[str, dict] = {}
    for op in ops:
        d, f = (statistics.median(samples[op][k]) for k in ("deepnvme", "fio"))
        result[op] = {"deepnvme": d, "fio": f, "ratio": d / f, "samples": samples[op]}
    result["meta"] = {"bytes": total, "repeats": repeats, "same_layout": same_layout, "fio_engine": engine}
    return result


def format_comparison(directory: str, config_text: str, result: dict[str, dict]) -> list[str]:
    """Lines for the tuner's output: the medians and ratio per op, then a warning per suspect ratio."""
    meta = result["meta"]
    ops = [op for op in ("write", "read") if op in result]
    lines = [f"deepnvme and fio ({meta['fio_engine']}) at the same settings ({config_text}) on one file of "
             f"{meta['bytes']} bytes in {directory}, {meta['repeats']} interleaved runs, medians: "
             + ", ".join(f"{op} {result[op]['deepnvme']:.2f} vs {result[op]['fio']:.2f} GB/sec "
                         f"(deepnvme/fio = {result[op]['ratio']:.2f}x)" for op in ops)]
    lines.append("(fio's figure leaves out its file open and thread start; deepnvme's includes its open)")
    if not meta["same_layout"]:
        lines.append("WARNING: the file's size or allocation changed during the comparison")
    warnings = [w for op in ops if (w := mismatch_warning(op, result[op]["ratio"]))]
    return lines + warnings + ([MISMATCH_CAUSES] if warnings else [])
