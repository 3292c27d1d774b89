#!/usr/bin/env python3
"""DeepSpeed's aio_handle cases for bench/aio_bench.py, run in a process of their own.

DeepSpeed allocates and locks a bounce buffer the size of every unaligned request; in the bench's process
that churn (and its idle handle threads) slowed deepnvme's own plain-tensor rows by about a quarter. Like
fio, DeepSpeed therefore runs beside the bench rather than inside it. Protocol on stdin/stdout, one line
each: the child prints ``READY <json cases>`` or ``UNAVAILABLE <reason>``, then answers every case index it
reads with ``<seconds> <cpu seconds>`` (or ``ERROR <text>``), until stdin closes. The child's stderr is the
bench's, so a slow DeepSpeed build or a crash shows in the log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent


class DeepSpeedSide:
    """Parent end: starts the child with `python` (an interpreter that can import deepspeed) and runs its
    cases on request. Sequential cases when `seq` is given (the grid points in `grid`, each
    [block, depth, threads, "locked" | "plain"]), small-request cases when `small_one` is given.
    ``cases`` lists [block, depth, threads, kind or name, op, bytes] per case index."""

    def __init__(self, python: str, seq: str = "", size: int = 0, grid: list[list] | None = None,
                 small_one: str = "", small_paths: list[str] | None = None) -> None:
        self.error: str | None = None
        self.failure: str | None = None
        self.cases: list[tuple] = []
        listing = Path(small_paths[0]).parent / "deepspeed_small_paths.json" if small_paths else None
        if listing:
            listing.write_text(json.dumps(small_paths))
        cmd = [python, str(Path(__file__).resolve()), "--seq", seq, "--size", str(size),
               "--grid", json.dumps(grid or []), "--small-one", small_one,
               "--small-paths", str(listing or "")]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         bufsize=1)  # stderr: the bench's
        except OSError as exc:
            self.proc = None
            self.error = f"cannot start {python}: {exc}"
            return
        first = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if first.startswith("READY "):
            self.cases = [tuple(c) for c in json.loads(first[len("READY "):])]
        else:
            self.error = first[len("UNAVAILABLE "):] if first.startswith("UNAVAILABLE ") else (
                f"its process exited with {self.proc.wait()}")
            self.close()

    def runner(self, index: int) -> Callable[[], tuple[float, float] | None]:
        """A Case.run for case `index`: the child times it, in its own process. None when the case failed
        or the child is gone (the first failure is kept in `failure`); the bench goes on without it."""
        def run() -> tuple[float, float] | None:
            if self.failure or not (self.proc and self.proc.stdin and self.proc.stdout):
                return None
            try:
                self.proc.stdin.write(f"{index}\n")
                answer = self.proc.stdout.readline().strip()
            except OSError as exc:  # BrokenPipeError: the child died
                answer = f"ERROR its process is gone ({exc})"
            if not answer or answer.startswith("ERROR"):
                self.failure = f"case {self.cases[index][:5]} failed: {answer or 'its process is gone'}"
                return None
            secs, cpu = answer.split()
            return float(secs), float(cpu)

        return run

    def close(self) -> None:
        """Close stdin (the child exits) and reap it."""
        if self.proc is None:
            return
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass  # already gone
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve(args: argparse.Namespace) -> int:
    """Child end: build DeepSpeed's cases, report them, run each index read from stdin."""
    # The protocol gets the real stdout; anything DeepSpeed prints goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from aio_cases import SMALL_COUNT, SMALL_SIZE, Setting, aio_seq, aio_small, handle_settings

    from deepnvme.tools.tune.fio import fio_shares

    try:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio = AsyncIOBuilder().load()
    except Exception as exc:  # noqa: BLE001 - any failure to import or build means nothing to compare
        print(f"UNAVAILABLE its async_io is unavailable: {type(exc).__name__}: {exc}".replace("\n", " "),
              file=proto)
        return 0

    def handle(block: int, depth: int, threads: int):
        kw = handle_settings("", depth, threads, block)
        kw.pop("engine")
        return aio.aio_handle(**kw)

    u8 = torch.empty(0, dtype=torch.uint8)
    runs: list[tuple[list, Callable[[], tuple[float, float]]]] = []
    grid = json.loads(args.grid)
    if args.seq and grid:
        # DeepSpeed treats a tensor as locked only when it allocated it itself.
        locked = aio.aio_handle().new_cpu_locked_tensor(args.size, u8)
        locked.fill_(7)
        plain = torch.empty(args.size, dtype=torch.uint8)
        plain.fill_(7)
        for block, depth, threads, kind in grid:
            s = Setting(block, depth, threads)
            total = fio_shares(args.size, s.jobs, s.block)[0] * s.jobs  # the bytes fio and deepnvme move
            h = handle(block, depth, threads)
            t = (locked if kind == "locked" else plain)[:total]
            for op in ("write", "read"):
                runs.append(([block, depth, threads, kind, op, total], aio_seq(h, t, args.seq, op)))
    if args.small_one:
        small = aio.aio_handle().new_cpu_locked_tensor(SMALL_COUNT * SMALL_SIZE, u8)
        views = list(small.view(SMALL_COUNT, SMALL_SIZE).unbind(0))
        paths = json.loads(Path(args.small_paths).read_text()) if args.small_paths else []
        nbytes = SMALL_COUNT * SMALL_SIZE
        for depth, threads in ((32, 1), (128, 2)):
            h = handle(1 << 20, depth, threads)
            offsets = [i * SMALL_SIZE for i in range(SMALL_COUNT)]
            runs.append(([0, depth, threads, f"one file, aio_handle QD{depth} P{threads}", "small", nbytes],
                         aio_small(h, views, [args.small_one] * SMALL_COUNT, offsets, count_check=False)))
            if paths:
                runs.append(([0, depth, threads, f"{SMALL_COUNT} files, aio_handle QD{depth} P{threads}",
                              "small", nbytes], aio_small(h, views, paths, [0] * SMALL_COUNT,
                                                          count_check=False)))
    print("READY " + json.dumps([desc for desc, _ in runs]), file=proto)
    for line in sys.stdin:
        try:
            secs, cpu = runs[int(line)][1]()
            print(f"{secs} {cpu}", file=proto)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the case
            print(f"ERROR {type(exc).__name__}: {exc}".replace("\n", " "), file=proto)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run as the child of aio_bench.py."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="")
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--grid", default="[]", help="JSON list of [block, depth, threads, kind]")
    p.add_argument("--small-one", default="")
    p.add_argument("--small-paths", default="")
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
