"""OffloadedOptimizer through torch.distributed.checkpoint with deepnvme's AioStorageWriter/AioStorageReader.

DCP saves a state dict of tensors and loads in place into a state dict of preallocated tensors. The
offloaded optimizer's state_dict() holds its whole state in memory, so it serves both: saved as is, and
(once the optimizer has state) as the tensors DCP loads into, handed back with load_state_dict(). A fresh
optimizer has no state to load into; torch's get_optimizer_state_dict makes it with a zero-gradient step
when `state` is empty, which is why the offloaded optimizer's `state` outlines what is on the drive:
otherwise that step would run on existing Adam state and decay it. Resuming must give the losses and
parameters of a run never interrupted, bit for bit, in one process and in two gloo processes with DDP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_helpers import launch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

from deepnvme.checkpoint import AioStorageReader, AioStorageWriter
from deepnvme.offload import OffloadedOptimizer
from tests.offload.optim_cases import OPTIMIZERS, model, rank_steps, train

STEPS = 12
HALF = 6
BUDGET = 64 << 10
DEADLINE_S = 240


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
def test_fresh_optimizer_resumes_from_dcp(dtype: torch.dtype, workdir: Path, tmp_path: Path) -> None:
    masters = dtype != torch.float32
    ref = model(dtype=dtype)
    ref_masters = [p.detach().float().clone() for p in ref.parameters()] if masters else None
    ref_opt = OPTIMIZERS["adamw"](ref_masters if masters else ref.parameters())
    ref_losses = train(ref, ref_opt, range(STEPS), masters=ref_masters)

    first = model(dtype=dtype)
    with OffloadedOptimizer(OPTIMIZERS["adamw"](first.parameters()), workdir, BUDGET,
                            master_weights=masters) as opt:
        losses = train(first, opt, range(HALF))
        opt.zero_grad(set_to_none=True)  # no gradients: torch's helper would step if `state` looked empty
        before = opt.state_dict()
        dcp.save({"model": first.state_dict(), "optim": get_optimizer_state_dict(first, opt)},
                 storage_writer=AioStorageWriter(tmp_path / "ckpt"))
        after = opt.state_dict()
        assert all(torch.equal(v, after["state"][i][k]) for i, st in before["state"].items()
                   for k, v in st.items() if isinstance(v, torch.Tensor))

    second = model(seed=7, dtype=dtype)
    with OffloadedOptimizer(OPTIMIZERS["adamw"](second.parameters()), workdir, BUDGET,
                            master_weights=masters) as opt:
        assert not opt.state
        target = {"model": second.state_dict(), "optim": get_optimizer_state_dict(second, opt)}
        assert opt.state  # the state DCP loads into exists now (made by torch's zero-gradient step)
        dcp.load(target, storage_reader=AioStorageReader(tmp_path / "ckpt"))
        second.load_state_dict(target["model"])
        set_optimizer_state_dict(second, opt, target["optim"])
        assert losses + train(second, opt, range(HALF, STEPS)) == ref_losses
        assert _same(ref, second)
        if masters:
            sd = opt.state_dict()
            assert all(torch.equal(sd["state"][i]["master"], w) for i, w in enumerate(ref_masters))


def test_rollback_with_plain_state_dict(workdir: Path, tmp_path: Path) -> None:
    """The optimizer's own state_dict() is the DCP state dict, saved and loaded in place, no helper."""
    ref = model()
    ref_opt = OPTIMIZERS["adam"](ref.parameters())
    ref_losses = train(ref, ref_opt, range(STEPS))

    net = model()
    with OffloadedOptimizer(OPTIMIZERS["adam"](net.parameters()), workdir, BUDGET) as opt:
        losses = train(net, opt, range(HALF))
        weights = {k: v.clone() for k, v in net.state_dict().items()}
        dcp.save({"optim": opt.state_dict()}, storage_writer=AioStorageWriter(tmp_path / "ckpt"))
        train(net, opt, range(HALF, HALF + 3))  # steps to be rolled back
        target = {"optim": opt.state_dict()}
        dcp.load(target, storage_reader=AioStorageReader(tmp_path / "ckpt"))
        opt.load_state_dict(target["optim"])
        net.load_state_dict(weights)
        assert losses + train(net, opt, range(HALF, STEPS)) == ref_losses
    assert _same(ref, net)


def _ddp_body(rank: int, world: int, swap: str, ckpt: str) -> dict[str, Any]:
    ref = DistributedDataParallel(model())
    ref_losses = rank_steps(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), rank, range(STEPS))

    first = DistributedDataParallel(model())
    with OffloadedOptimizer(torch.optim.Adam(first.parameters(), lr=1e-2), swap, BUDGET) as opt:
        losses = rank_steps(first, opt, rank, range(HALF))
        opt.zero_grad(set_to_none=True)
        dcp.save({"model": first.state_dict(), "optim": get_optimizer_state_dict(first, opt)},
                 storage_writer=AioStorageWriter(ckpt))
    second = DistributedDataParallel(model(seed=3))
    with OffloadedOptimizer(torch.optim.Adam(second.parameters(), lr=1e-2), swap, BUDGET) as opt:
        target = {"model": second.state_dict(), "optim": get_optimizer_state_dict(second, opt)}
        dcp.load(target, storage_reader=AioStorageReader(ckpt))
        second.load_state_dict(target["model"])
        set_optimizer_state_dict(second, opt, target["optim"])
        losses += rank_steps(second, opt, rank, range(HALF, STEPS))
    same = all(torch.equal(p, q) for p, q in zip(ref.parameters(), second.parameters()))
    return {"ref": ref_losses, "resumed": losses, "same": same}


def test_ddp_two_ranks_resume_from_dcp(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    per_rank = launch(2, _ddp_body, (str(swap), str(tmp_path / "ckpt")), tmp_path, DEADLINE_S)
    for rank, res in enumerate(per_rank):
        assert res["resumed"] == res["ref"], rank
        assert res["same"], rank
    assert per_rank[0]["ref"] != per_rank[1]["ref"]  # the ranks saw different batches
