"""Real torch.distributed process groups for tests: gloo on localhost, spawned processes, a deadline."""

from __future__ import annotations

import datetime
import multiprocessing
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _run_rank(rank: int, world: int, rendezvous: str, body: Callable[..., Any], args: tuple,
              out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(body(rank, world, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def launch(world: int, body: Callable[..., Any], args: tuple, out_dir: Path, deadline_s: float) -> list[Any]:
    """Run `body(rank, world, *args)` in `world` spawned processes of one gloo group; their results by rank.

    Fails (never hangs) if a process errs or is still running after `deadline_s`. `body` must be a
    module-level function (spawn pickles it by name).
    """
    ctx = multiprocessing.get_context("spawn")
    # A file in out_dir (fresh for each launch) as the rendezvous: no TCP port to lose to another process
    # between choosing it and listening on it.
    rendezvous = f"file://{out_dir}/rendezvous-{uuid.uuid4().hex}"
    procs = [ctx.Process(target=_run_rank, args=(r, world, rendezvous, body, args, str(out_dir)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(deadline_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {deadline_s}s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
