"""Rank bodies for the parallel FastFileWriter test: real torch.distributed (gloo) in separate processes.

    python3 tests/support/ffw_workers.py RANK WORLD FOLDER

Each rank writes its share of shared files, then rank 0 checks every file after a barrier. Ranks build
the same objects from one seed, so they serialise to the same byte stream. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import io
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepnvme.io as dio  # noqa: E402
from deepnvme import AsyncIOBuilder  # noqa: E402
from deepnvme._core.memory import memory_of  # noqa: E402

STRIPE = 64 << 10  # small stripes, so that a 1 MB state dict gives each rank many of them


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(20_000 + 999 * i, generator=g) for i in range(12)}


def stream_of(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def main(rank: int, world: int, folder: str) -> None:
    dio.STRIPE_BYTES = STRIPE
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    handle = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1)
    sd = state_dict()
    storages = [(t.untyped_storage(), t.dtype) for t in sd.values()]

    def writer(path: str) -> dio.FastFileWriter:
        staging = torch.empty(256 << 10, dtype=torch.uint8)
        config = dio.FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=staging,
                                          num_parallel_writers=world, writer_rank=rank, global_rank=rank)
        return dio.FastFileWriter(file_path=path, config=config)

    shared = os.path.join(folder, "shared.pt")
    if rank == 0:  # a longer file already there: its tail must not survive
        with open(shared, "wb") as f:
            f.write(os.urandom(5 << 20))
    dist.barrier()
    w = writer(shared)
    torch.save(sd, w)
    w.close()
    mine = w._writer.bytes_staged + w._writer.bytes_direct

    listed = os.path.join(folder, "storages.bin")
    w = writer(listed)
    written = w.save_torch_storage_object_list(storages, True)
    w.close()

    own = os.path.join(folder, f"ds.pt-{rank}.{world}")  # DeepSpeed's per-rank names: the whole stream each
    w = writer(own)
    torch.save(sd, w)
    w.close()
    dist.barrier()

    if rank == 0:
        expected = stream_of(sd)
        with open(shared, "rb") as f:
            assert f.read() == expected, "shared file differs from torch.save's bytes"
        assert mine < 0.75 * len(expected), f"rank 0 wrote {mine} of {len(expected)} bytes: not a share"
        loaded = torch.load(shared, weights_only=True)
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)
        want = b"".join(struct_count(t) + bytes(memory_of(t)) for t in sd.values())
        with open(listed, "rb") as f:
            assert f.read() == want, "storage list file differs"
        for r in range(world):
            with open(os.path.join(folder, f"ds.pt-{r}.{world}"), "rb") as f:
                assert f.read() == expected, f"per-rank file of rank {r} differs"
    total = torch.tensor([written])
    dist.all_reduce(total)
    assert total.item() == sum(8 + t.numel() * 4 for t in sd.values()), total
    dist.barrier()
    dist.destroy_process_group()


def struct_count(t: torch.Tensor) -> bytes:
    return int(t.numel()).to_bytes(8, "little", signed=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
