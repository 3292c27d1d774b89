"""OffloadedOptimizer against the same optimizer in memory: bit-identical parameters, state and losses."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from deepnvme.offload import OffloadedOptimizer
from deepnvme.offload._doors import SWAP
from deepnvme.offload.train.tile_walk import END_REQUESTS
from tests.offload.helpers import flip_byte
from tests.offload.optim_cases import BASE, OPTIMIZERS, PerParameter, model, train

STEPS = 20
# torch's fused SGD fails (TypeError) when a parameter gets its first gradient after the others: there the
# whole model trains from the first step.
LATE_START = {"sgd-fused": 0}
BUDGET = 64 << 10  # a few KiB per tile: every step walks several tiles


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        if not isinstance(st, dict):  # state not keyed by a parameter
            assert st == b["state"][i], i
            continue
        assert st.keys() == b["state"][i].keys(), i
        for k, v in st.items():
            w = b["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp32_bit_identical(name: str, workdir: Path) -> None:
    ref, off = model(), model()
    late = LATE_START.get(name, 3)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    sched_ref = torch.optim.lr_scheduler.StepLR(ref_opt, 5, gamma=0.5)
    with OffloadedOptimizer(OPTIMIZERS[name](off.parameters()), workdir, BUDGET) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)
        for s in range(STEPS):
            a = train(ref, ref_opt, range(s, s + 1), frozen_until=late)
            b = train(off, opt, range(s, s + 1), frozen_until=late)
            sched_ref.step()
            sched.step()
            assert a == b, s
            if s == 12:  # a param_groups edit is seen by the next step
                for g in (ref_opt.param_groups[0], opt.param_groups[0]):
                    g["lr"] *= 3
        assert _same(ref, off)
        assert opt.param_groups is opt.optimizer.param_groups
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        _same_state(ref_opt.state_dict(), opt.state_dict())
        assert not opt.optimizer.state  # nothing of the state stays in memory between steps
        assert opt.swap.pool.peak_in_use <= BUDGET


@pytest.mark.parametrize("name", BASE)
def test_bf16_master_weights_bit_identical(name: str, workdir: Path) -> None:
    ref, off = model(dtype=torch.bfloat16), model(dtype=torch.bfloat16)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = OPTIMIZERS[name](masters)
    with OffloadedOptimizer(OPTIMIZERS[name](off.parameters()), workdir, BUDGET, master_weights=True) as opt:
        assert train(ref, ref_opt, range(STEPS), masters=masters) == train(off, opt, range(STEPS))
        assert _same(ref, off) and next(off.parameters()).dtype == torch.bfloat16
        sd = opt.state_dict()
        for i, w in enumerate(masters):
            assert torch.equal(sd["state"][i]["master"], w)


@pytest.mark.parametrize("name", ["adam", "sgd-foreach", "adagrad-fused"])
def test_save_load_resume_identical(name: str, workdir: Path, tmp_path: Path) -> None:
    ref = model()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    ref_losses = train(ref, ref_opt, range(STEPS))

    first = model()
    ckpt = tmp_path / "opt.pt"
    with OffloadedOptimizer(OPTIMIZERS[name](first.parameters()), workdir, BUDGET) as opt:
        losses = train(first, opt, range(10))
        opt.save(ckpt)
        _same_state(opt.state_dict(), torch.load(ckpt))
    weights = {k: v.clone() for k, v in first.state_dict().items()}

    # A plain optimizer takes the file.
    plain_model = model()
    plain_model.load_state_dict(weights)
    plain = OPTIMIZERS[name](plain_model.parameters())
    plain.load_state_dict(torch.load(ckpt))
    assert losses + train(plain_model, plain, range(10, STEPS)) == ref_losses

    # So does a new offloaded optimizer, streamed.
    second = model(seed=5)
    second.load_state_dict(weights)
    with OffloadedOptimizer(OPTIMIZERS[name](second.parameters()), workdir, BUDGET) as opt:
        opt.load(ckpt)
        assert losses + train(second, opt, range(10, STEPS)) == ref_losses
    assert _same(ref, second) and _same(ref, plain_model)


def test_master_weights_carried_by_checkpoints(workdir: Path, tmp_path: Path) -> None:
    ref = model(dtype=torch.bfloat16)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = OPTIMIZERS["adam"](masters)
    ref_losses = train(ref, ref_opt, range(STEPS), masters=masters)

    first = model(dtype=torch.bfloat16)
    inner = OPTIMIZERS["adam"](first.parameters())
    with OffloadedOptimizer(inner, workdir, BUDGET, master_weights=True) as opt:
        losses = train(first, opt, range(10))
        opt.save(tmp_path / "a.pt")
        whole = opt.state_dict()
    weights = {k: v.clone() for k, v in first.state_dict().items()}
    for how in ("load", "load_state_dict"):
        second = model(seed=9, dtype=torch.bfloat16)
        second.load_state_dict(weights)
        with OffloadedOptimizer(OPTIMIZERS["adam"](second.parameters()), workdir, BUDGET,
                                master_weights=True) as opt:
            opt.load(tmp_path / "a.pt") if how == "load" else opt.load_state_dict(whole)
            assert losses + train(second, opt, range(10, STEPS)) == ref_losses, how
        assert _same(ref, second)


def test_last_step_profiles_the_pipeline(workdir: Path) -> None:
    """last_step: every swapped byte read once and written once, one read and one write request per tile
    (its units lie back to back) but END_REQUESTS for the first tile's read and the last tile's read and
    write (every queue thread serves the ends of the walk), spans inside the step and updates one after
    another."""
    m = model()
    with OffloadedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-3, fused=True), workdir, BUDGET) as opt:
        train(m, opt, range(3))
        prof = opt.last_step
        assert prof is not None and len(prof.updates) >= 3
        extra = END_REQUESTS - 1  # every tile here is at least END_REQUESTS pages
        assert len(prof.reads) == len(prof.updates) + 2 * extra
        assert len(prof.writes) == len(prof.updates) + extra
        assert opt.swap.handle_settings["block_size"] == SWAP["block_size"]
        assert prof.bytes_read == prof.bytes_written == opt.swap.reserved_bytes
        assert prof.bytes_written == sum(n for *_, n in prof.writes)
        assert sum(n for *_, n in prof.updates) == sum(p.numel() * 4 for p in m.parameters())
        for a, b, _ in prof.reads + prof.updates + prof.writes:
            assert prof.began <= a <= b <= prof.ended
        assert all(x[1] <= y[0] for x, y in zip(prof.updates, prof.updates[1:]))
        assert 0 <= prof.read_wait_s <= prof.ended - prof.began


def test_wrapping_an_optimizer_that_has_state(workdir: Path) -> None:
    ref, off = model(), model()
    ref_opt, inner = OPTIMIZERS["adam"](ref.parameters()), OPTIMIZERS["adam"](off.parameters())
    assert train(ref, ref_opt, range(3)) == train(off, inner, range(3))
    with OffloadedOptimizer(inner, workdir, BUDGET) as opt:
        assert not inner.state
        assert train(ref, ref_opt, range(3, 8)) == train(off, opt, range(3, 8))


def test_close_removes_files_and_fds(workdir: Path) -> None:
    from tests.offload.helpers import open_fds

    before = open_fds()
    m = model()
    opt = OffloadedOptimizer(OPTIMIZERS["adam"](m.parameters()), workdir, BUDGET)
    train(m, opt, range(2))
    assert os.listdir(workdir)
    opt.close()
    opt.close()
    assert os.listdir(workdir) == []
    assert open_fds() - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def test_masters_of_a_stateless_optimizer_are_kept(workdir: Path) -> None:
    """SGD without momentum keeps no state, yet with master_weights its fp32 masters must carry from step to
    step (else training silently becomes plain bf16): bit-identical to SGD over fp32 masters in memory."""
    make = lambda ps: torch.optim.SGD(ps, lr=1e-2)  # noqa: E731
    ref, off = model(dtype=torch.bfloat16), model(dtype=torch.bfloat16)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = make(masters)
    with OffloadedOptimizer(make(off.parameters()), workdir, BUDGET, master_weights=True) as opt:
        assert train(ref, ref_opt, range(STEPS), masters=masters) == train(off, opt, range(STEPS))
        assert _same(ref, off)
        sd = opt.state_dict()
        for i, w in enumerate(masters):
            assert torch.equal(sd["state"][i]["master"], w)


class Fp32Momentum(PerParameter):
    """Momentum SGD that keeps its momentum in fp32 whatever the parameters' dtype (as mixed-precision
    optimizers do): offload must keep that state fp32, not the parameter's bf16."""

    def update(self, p: torch.Tensor, st: dict, group: dict) -> None:
        m = st.setdefault("m", torch.zeros(p.shape, dtype=torch.float32))
        m.mul_(0.9).add_(p.grad.float())
        p.add_(m.to(p.dtype), alpha=-group["lr"])


def test_state_keeps_its_own_dtype(workdir: Path) -> None:
    ref, off = model(dtype=torch.bfloat16), model(dtype=torch.bfloat16)
    ref_opt = Fp32Momentum(ref.parameters())
    with OffloadedOptimizer(Fp32Momentum(off.parameters()), workdir, BUDGET) as opt:
        assert train(ref, ref_opt, range(STEPS)) == train(off, opt, range(STEPS))
        assert _same(ref, off)
        assert all(st["m"].dtype == torch.float32 for st in opt.state.values())
        _same_state(ref_opt.state_dict(), opt.state_dict())


class GroupClipped(torch.optim.Optimizer):
    """Momentum SGD whose gradients are clipped by their norm over the whole group, with a counter in its
    param_groups and one in state not keyed by a parameter: stepped a tile at a time it would compute
    another norm per tile and count tiles, so offload must step it whole."""

    def __init__(self, params: object, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "calls": 0})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        self.state["steps"] = self.state.get("steps", 0) + 1
        for group in self.param_groups:
            group["calls"] += 1
            ps = [p for p in group["params"] if p.grad is not None]
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ps)) if ps else torch.tensor(0.0)
            scale = min(1.0, 0.5 / (float(norm) + 1e-6))
            for p in ps:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(0.9).add_(p.grad, alpha=scale)
                p.add_(m, alpha=-group["lr"] / group["calls"] ** 0.5)


def test_an_optimizer_that_works_across_the_group_is_stepped_whole(workdir: Path, tmp_path: Path) -> None:
    ref, off = model(), model()
    ref_opt = GroupClipped(ref.parameters())
    with OffloadedOptimizer(GroupClipped(off.parameters()), workdir, BUDGET) as opt:
        assert not opt.elementwise
        assert train(ref, ref_opt, range(STEPS)) == train(off, opt, range(STEPS))
        assert _same(ref, off)
        assert opt.param_groups[0]["calls"] == ref_opt.param_groups[0]["calls"] == STEPS
        assert len(opt.last_step.updates) == 1  # one call over every parameter
        _same_state(ref_opt.state_dict(), opt.state_dict())  # "steps" (not a parameter's) included
        opt.save(tmp_path / "o.pt")
    again = model()
    again.load_state_dict(off.state_dict())
    with OffloadedOptimizer(GroupClipped(again.parameters()), workdir, BUDGET) as opt:
        opt.load(tmp_path / "o.pt")
        assert train(ref, ref_opt, range(STEPS, STEPS + 3)) == train(again, opt, range(STEPS, STEPS + 3))
        assert _same(ref, again)
        _same_state(ref_opt.state_dict(), opt.state_dict())


def test_a_whole_step_that_does_not_fit_is_refused_before_anything_moves(workdir: Path) -> None:
    """Refused when the optimizer is made, by the state its step will make (learnt ahead, exact: the
    number given is the least budget that works); and at a later step, for parameters added since, before
    the parameters move or any state is made."""
    m = model(width=64)
    with pytest.raises(ValueError, match=r"GroupClipped is not known to update each parameter.*needs "
                                         r"(\d+) bytes, and budget_bytes.*elementwise=True") as caught:
        OffloadedOptimizer(GroupClipped(m.parameters()), workdir, 5 * 4096)
    need = int(re.search(r"needs (\d+) bytes", str(caught.value)).group(1))
    with OffloadedOptimizer(GroupClipped(m.parameters()), workdir, need) as opt:
        train(m, opt, range(2))  # the number given is enough
    first, *rest = list(m.parameters())
    with OffloadedOptimizer(GroupClipped([first]), workdir, need // 2) as opt:
        opt.add_param_group({"params": rest})
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(ValueError, match=r"GroupClipped is not known to update each parameter"):
            train(m, opt, range(1))
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
        assert opt.state_dict()["state"] == {} and opt.swap.reserved_bytes == 0


def test_a_whole_step_sees_every_group_every_step(workdir: Path) -> None:
    """Stepped whole, the optimizer sees its groups as in memory: one whose parameters have no gradient
    this step, and a step where none has one (its counters move all the same)."""
    def groups(m: torch.nn.Module) -> list[dict]:
        ps = list(m.parameters())
        return [{"params": ps[:2]}, {"params": ps[2:]}]

    ref, off = model(), model()
    ref_opt = GroupClipped(groups(ref))
    with OffloadedOptimizer(GroupClipped(groups(off)), workdir, 1 << 20) as opt:
        for s in range(6):
            a = train(ref, ref_opt, range(s, s + 1), frozen_until=3)  # the first layer: no gradient until 3
            b = train(off, opt, range(s, s + 1), frozen_until=3)
            assert a == b, s
        for o in (ref_opt, opt):
            for p in (ref if o is ref_opt else off).parameters():
                p.grad = None
            o.step()
        assert _same(ref, off)
        assert [g["calls"] for g in opt.param_groups] == [g["calls"] for g in ref_opt.param_groups] == [7, 7]
        _same_state(ref_opt.state_dict(), opt.state_dict())


def test_elementwise_is_what_the_caller_declares(workdir: Path) -> None:
    """A custom element-wise optimizer declared so is stepped a tile at a time, bit-identical; a bad value
    of the argument is a TypeError naming it."""
    ref, off = model(), model()
    ref_opt = Fp32Momentum(ref.parameters())
    with OffloadedOptimizer(Fp32Momentum(off.parameters()), workdir, BUDGET, elementwise=True) as opt:
        assert train(ref, ref_opt, range(STEPS)) == train(off, opt, range(STEPS))
        assert _same(ref, off) and len(opt.last_step.updates) > 1
    with pytest.raises(TypeError, match="elementwise"):
        OffloadedOptimizer(Fp32Momentum(model().parameters()), workdir, BUDGET, elementwise=1)  # type: ignore


def test_a_flipped_byte_of_swapped_state_is_an_error(workdir: Path) -> None:
    m = model()
    with OffloadedOptimizer(OPTIMIZERS["adam"](m.parameters()), workdir, BUDGET) as opt:
        train(m, opt, range(2))
        flip_byte(opt.swap.file, 100)
        with pytest.raises(OSError, match=r"swapped unit 'param-1'.*CRC-32") as err:
            train(m, opt, range(2, 3))
        assert err.value.filename == opt.swap.file


def test_the_next_tiles_read_is_queued_before_this_tile_updates(workdir: Path) -> None:
    """The overlap, held by the request log and not only by the bench: in a step over state that exists,
    each tile's reads are queued before the update of the tile ahead of it begins (the read-ahead); the
    first tile's, before any update."""
    m = model()
    # Small tiles in a pool with room for all of them: how far ahead reads run never waits on write-backs.
    with OffloadedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-3), workdir, 1 << 20,
                            tile_bytes=16 << 10) as opt:
        train(m, opt, range(3))
        prof = opt.last_step
        queued, updates = prof.tile_reads_queued, prof.updates
        assert len(queued) == len(updates) >= 3 and None not in queued
        assert queued[0] < updates[0][0]
        for i in range(1, len(updates)):
            assert queued[i] < updates[i - 1][0], (i, queued[i] - updates[i - 1][0])
