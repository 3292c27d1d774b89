"""OffloadedOptimizer on torch's distributed engines (gloo, 2 processes): each rank offloads its own state.

Each rank trains the same model on its own batches twice, from the same seed: with the plain optimizer and
with it offloaded (every rank in its own subdirectory of one shared swap directory). Losses and parameters
must be equal, bit for bit. With ZeroRedundancyOptimizer the optimizer it makes for the rank's shard is
the one offloaded, so each rank swaps only its shard.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from dist_helpers import launch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from deepnvme.offload import OffloadedOptimizer
from tests.offload.optim_cases import model, rank_steps

STEPS = 8
DEADLINE_S = 240
BUDGET = 64 << 10


def _run(rank: int, kind: str, offload: bool, directory: str) -> tuple[list[float], list[torch.Tensor], int]:
    net = DistributedDataParallel(model())
    if kind == "zero":
        opt: Any = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
        if offload:
            opt.optim = OffloadedOptimizer(opt.optim, directory, BUDGET)
        inner = opt.optim
    else:
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        if offload:
            opt = OffloadedOptimizer(opt, directory, BUDGET)
        inner = opt
    losses = rank_steps(net, opt, rank, range(STEPS))
    swapped = inner.swap.reserved_bytes if offload else 0
    if offload:
        inner.close()
    return losses, [p.detach().clone() for p in net.parameters()], swapped


def _body(rank: int, world: int, directory: str) -> dict[str, Any]:
    out = {}
    for kind in ("ddp", "zero"):
        out[kind] = {"plain": _run(rank, kind, False, directory),
                     "offload": _run(rank, kind, True, directory)}
    out["left"] = os.listdir(directory)
    return out


def test_ddp_and_zero_redundancy_equal_to_in_memory(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    per_rank = launch(2, _body, (str(swap),), tmp_path, DEADLINE_S)
    total = sum(p.numel() for p in model().parameters())
    for rank, res in enumerate(per_rank):
        for kind in ("ddp", "zero"):
            plain, off = res[kind]["plain"], res[kind]["offload"]
            assert plain[0] == off[0], (rank, kind)
            assert all(torch.equal(a, b) for a, b in zip(plain[1], off[1])), (rank, kind)
        # DDP: every rank holds Adam's whole state; ZeRO: only its shard (a part of it).
        assert res["ddp"]["offload"][2] >= 2 * 4 * total
        assert 0 < res["zero"]["offload"][2] < res["ddp"]["offload"][2]
    # Both ranks' shards together hold the whole state; the ranks' files were apart and are gone.
    assert sum(r["zero"]["offload"][2] for r in per_rank) >= 2 * 4 * total
    assert per_rank[0]["ddp"]["plain"][0] != per_rank[1]["ddp"]["plain"][0]  # ranks saw different batches
    assert os.listdir(swap) == []
