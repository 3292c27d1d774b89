"""Process bodies for the DCP backend tests: real torch.distributed (gloo, CPU) in 2 and 4 processes.

They live in their own module (not the test file) so that spawned children import them by a stable name.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# name -> (shape, placement saved at world 4, placement loaded at world 2); odd sizes shard unevenly.
SHARDED = {
    "emb": ((1030, 64), Shard(0), Shard(0)),
    "proj": ((48, 1030), Shard(0), Shard(1)),  # resharded across the other dimension: non-contiguous pieces
    "bias": ((30,), Shard(0), Replicate()),
}


def run(world: int, fn: Callable[..., None], *args: Any, timeout: float = 90.0) -> None:
    """Run fn(rank, world, rendezvous, *args) in `world` spawned processes (`rendezvous`: the process group's
    init_method, a file of a fresh directory, so no TCP port can be taken in between); raise if one fails or
    time runs out."""
    import multiprocessing

    import torch.multiprocessing as mp

    # Children fork from a server that imported torch once: four fresh interpreters each importing torch
    # cost more than the checkpoint work, and forking the test process itself (with live I/O threads) is
    # not safe.
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.checkpoint", __name__])
    where = tempfile.TemporaryDirectory(prefix="deepnvme-rendezvous-")
    ctx = mp.start_processes(fn, args=(world, f"file://{where.name}/store", *args), nprocs=world, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} in {world} processes did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
        where.cleanup()


def _init(rank: int, world: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)


def full_tensor(name: str) -> torch.Tensor:
    """The value every rank agrees on for `name` (seeded by its name)."""
    shape = SHARDED[name][0] if name in SHARDED else (257, 33)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def save_world(rank: int, world: int, rendezvous: str, ours: str, stock: str) -> None:
    """Save DTensors sharded over `world` CPU ranks, a replicated tensor and a Python value: with our writer
    into `ours`, with FileSystemWriter into `stock`."""
    from deepnvme.checkpoint import AioStorageWriter

    _init(rank, world, rendezvous)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd: dict[str, Any] = {n: distribute_tensor(full_tensor(n), mesh, [saved]) for n, (_, saved, _) in
                              SHARDED.items()}
        sd["rep"] = full_tensor("rep")
        sd["step"] = 11
        dcp.save(sd, storage_writer=AioStorageWriter(ours, thread_count=2))
        dcp.save(sd, storage_writer=FileSystemWriter(stock))
    finally:
        dist.destroy_process_group()


def load_world(rank: int, world: int, rendezvous: str, directories: list[str]) -> None:
    """Load each checkpoint with both readers into differently sharded DTensors and check every value."""
    from deepnvme.checkpoint import AioStorageReader

    _init(rank, world, rendezvous)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for directory in directories:
            for reader in (AioStorageReader(directory), FileSystemReader(directory)):
                sd: dict[str, Any] = {n: distribute_tensor(torch.zeros(shape), mesh, [loaded])
                                      for n, (shape, _, loaded) in SHARDED.items()}
                sd["rep"] = torch.zeros(257, 33)
                sd["step"] = 0
                dcp.load(sd, storage_reader=reader)
                for n in SHARDED:
                    got = sd[n]
                    if not isinstance(got, DTensor) or not torch.equal(got.full_tensor(), full_tensor(n)):
                        raise AssertionError(f"{n} differs after loading {directory} with {reader}")
                if not torch.equal(sd["rep"], full_tensor("rep")) or sd["step"] != 11:
                    raise AssertionError(f"rep/step differ after loading {directory} with {reader}")
    finally:
        dist.destroy_process_group()


def _train(steps: int, checkpoint_at: int | None, directory: str | None) -> tuple[dict, dict | None]:
    """A few SGD steps on a small model; optionally dcp.async_save at one step and keep training meanwhile."""
    from deepnvme.checkpoint import AioStorageWriter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    future, snapshot = None, None
    for step in range(steps):
        x = torch.randn(32, 256, generator=data)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == checkpoint_at:
            snapshot = {k: v.clone() for k, v in model.state_dict().items()}
            future = dcp.async_save(model.state_dict(), storage_writer=AioStorageWriter(directory))
    if future is not None:
        future.result()
    return {k: v.clone() for k, v in model.state_dict().items()}, snapshot


def async_world(rank: int, world: int, rendezvous: str, directory: str) -> None:
    """Training with an async_save in the middle ends where training without it ends; the checkpoint holds
    the weights of the step it was taken at."""
    from deepnvme.checkpoint import AioStorageReader

    _init(rank, world, rendezvous)
    try:
        plain, _ = _train(8, None, None)
        with_ckpt, snapshot = _train(8, 2, directory)
        for k in plain:
            if not torch.equal(plain[k], with_ckpt[k]):
                raise AssertionError(f"training changed by async_save: {k}")
        back = {k: torch.zeros_like(v) for k, v in snapshot.items()}
        dcp.load(back, storage_reader=AioStorageReader(directory))
        for k in back:
            if not torch.equal(back[k], snapshot[k]):
                raise AssertionError(f"checkpoint differs from the weights at the saved step: {k}")
    finally:
        dist.destroy_process_group()
