"""offload_parameters: a model's parameters and gradients on the drive between uses, trained with
OffloadedOptimizer, bit-identical to the same training in memory (issue 36, one process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from deepnvme.offload import OffloadedOptimizer, StreamedWeightError
from deepnvme.offload.train import offload_parameters
from tests.offload.helpers import flip_byte
from tests.offload.train_models import KINDS, build, loss, train, units_of

STEPS = 20
BUDGET = 4 << 20
OPT_BUDGET = 8 << 20


def _hf(kind: str) -> None:
    if kind != "sequential":
        pytest.importorskip("transformers", reason="the offload extra (transformers) is needed")


def _run(kind: str, workdir: Path, *, dtype: torch.dtype = torch.float32, checkpointing: str = "none",
         accumulate: int = 1, set_to_none: bool = True, steps: int = STEPS) -> dict[str, int]:
    """Train the model in memory and offloaded; losses and final parameters must be equal bit for bit.
    Returns the offload's stats()."""
    stats: dict[str, int] = {}
    _hf(kind)
    masters = dtype != torch.float32
    ref, m = build(kind, dtype, checkpointing), build(kind, dtype, checkpointing)
    inner = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_opt = OffloadedOptimizer(inner, workdir, OPT_BUDGET, master_weights=True) if masters else inner
    with offload_parameters(m, workdir, BUDGET, units=units_of(kind, m)) as off, \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET,
                               master_weights=masters) as opt:
        want = train(kind, ref, ref_opt, steps, accumulate, set_to_none)
        got = train(kind, m, opt, steps, accumulate, set_to_none)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), [(a.item(), b.item())
                                                                    for a, b in zip(want, got)]
        assert off.stats()["bytes_written"] > 0
        stats.update(off.stats())
    if masters:
        ref_opt.close()
    for (name, a), b in zip(ref.named_parameters(), m.parameters()):
        assert type(b) is nn.Parameter and torch.equal(a, b), name
    return stats


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_adamw_is_bit_identical(kind: str, workdir: Path) -> None:
    stats = _run(kind, workdir)
    assert stats["lent"] >= STEPS, stats  # units computed in the pool memory they were read into


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation_is_bit_identical(kind: str, workdir: Path) -> None:
    _run(kind, workdir, accumulate=3, steps=8)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
@pytest.mark.parametrize("checkpointing", ["reentrant", "nonreentrant"])
def test_activation_checkpointing_is_bit_identical(kind: str, checkpointing: str, workdir: Path) -> None:
    _run(kind, workdir, checkpointing=checkpointing, accumulate=2, steps=8)


@pytest.mark.parametrize("kind", ["sequential", "llama", "mixtral"])
def test_bf16_with_fp32_masters_is_bit_identical(kind: str, workdir: Path) -> None:
    _run(kind, workdir, dtype=torch.bfloat16)
    _run(kind, workdir, dtype=torch.bfloat16, checkpointing="nonreentrant", accumulate=2, steps=4) \
        if kind != "sequential" else None


def test_zero_grad_keeping_zeros_is_bit_identical(workdir: Path) -> None:
    _run("sequential", workdir, accumulate=2, set_to_none=False, steps=8)


def test_frozen_parameters_move_no_gradient(workdir: Path) -> None:
    """Fine-tuning a mostly frozen model: frozen parameters are read for forward and backward, but no
    gradient of theirs is written, and they have no optimizer state."""
    ref, m = build("sequential"), build("sequential")
    for net in (ref, m):
        for p in [*net[1].parameters(), *net[3].parameters()]:
            p.requires_grad_(False)
    grad_bytes = sum(p.numel() * p.element_size() for mod in (m[4], m[5]) for p in mod.parameters())
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)) as off, \
            OffloadedOptimizer(torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3),
                               workdir, OPT_BUDGET) as opt:
        train("sequential", ref, ref_opt, 3)
        train("sequential", m, opt, 2)
        before = off.stats()["bytes_written"]
        train("sequential", m, opt, 1, start=2)
        # one step writes the trainable units' gradients (backward) and parameters (step), nothing frozen
        assert off.stats()["bytes_written"] - before == 2 * grad_bytes
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))


def test_an_optimizer_made_before_the_offload_is_refused(workdir: Path) -> None:
    """An optimizer given the parameters before offload_parameters holds the tensors autograd uses, whose
    values are on the drive between uses: an OffloadedOptimizer refuses them, a torch optimizer raises
    naming the gradient (never a silent step that skips them, never memory out of bounds)."""
    m = build("sequential")
    early = OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET)
    plain = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)), early:
        loss("sequential", m, 0, 0).backward()
        with pytest.raises(ValueError, match="after offload_parameters"):
            early.step()
        with pytest.raises(StreamedWeightError, match=r"[0-9]\.weight\.grad lies on the drive"):
            plain.step()


def test_stand_ins_refuse_computation_naming_the_parameter(workdir: Path) -> None:
    m = build("sequential")
    ids = list(m.parameters())
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        assert [id(p) for p in m.parameters()] != [id(p) for p in ids]  # stand-ins in the blocks
        w = m[1].weight
        assert w.shape == (64, 32) and w.dtype == torch.float32 and w.requires_grad
        with pytest.raises(StreamedWeightError, match=r"1\.weight lies on the drive.*unit '1'"):
            w.sum()
        loss("sequential", m, 0, 0).backward()
        assert m[1].weight.grad is not None
        with pytest.raises(StreamedWeightError, match=r"1\.weight\.grad lies on the drive"):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        plain = torch.optim.SGD(m.parameters(), lr=0.1)
        with pytest.raises(StreamedWeightError, match="OffloadedOptimizer"):
            plain.step()
        assert m[1].weight is w  # the same objects throughout: optimizers keep them
    assert type(m[1].weight) is nn.Parameter and m[1].weight.grad is not None  # back, with the gradient


def test_close_puts_values_and_gradients_back(workdir: Path) -> None:
    ref, m = build("sequential"), build("sequential")
    off = offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m))
    loss("sequential", ref, 0, 0).backward()
    loss("sequential", m, 0, 0).backward()
    files = set(os.listdir(workdir))
    assert files
    off.close()
    off.close()
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    assert not os.listdir(workdir) or not any(os.listdir(workdir / f) for f in os.listdir(workdir))
    with pytest.raises(RuntimeError, match="closed"):
        off.enter(off.units[0])


def test_a_budget_below_the_largest_unit_is_refused_with_the_number(workdir: Path) -> None:
    m = build("sequential")
    need = 2 * (64 * 64 + 64) * 4  # the largest unit, m[3]: parameters and gradients
    with pytest.raises(ValueError, match=rf"at least {need + 2 * 4096 - need % 4096 * 0}|at least"):
        offload_parameters(m, workdir, 8192, units=units_of("sequential", m))
    assert m[3].weight.__class__ is nn.Parameter  # nothing moved


def test_a_flipped_byte_on_the_drive_is_an_error_naming_the_file(workdir: Path) -> None:
    """A unit read back with another CRC-32 than it was written with raises OSError EIO naming the file and
    the unit, never used; with the byte put back, the model runs again."""
    m, ref = build("sequential"), build("sequential")
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)) as off:
        loss("sequential", m, 0, 0)

        flip_byte(off.space.file, 10)
        with pytest.raises(OSError, match=r"swapped unit '1\.weight'.*CRC-32") as err:
            loss("sequential", m, 0, 0)
        assert err.value.filename == off.space.file
        flip_byte(off.space.file, 10)
        assert torch.equal(loss("sequential", m, 0, 0), loss("sequential", ref, 0, 0))


def test_the_next_units_are_read_while_this_one_computes(workdir: Path) -> None:
    """The overlap, held by the reads in flight and not only by a bench: while a unit runs its forward, the
    next one's read is issued; when its backward begins, the one before it (with its gradients) is, and is
    still in flight or waiting as that backward ends."""
    m = build("sequential")
    units = units_of("sequential", m)
    seen: dict[str, list[int]] = {"forward": [], "backward": []}
    with offload_parameters(m, workdir, BUDGET, units=units, ahead=1) as off:
        def forward_hook(mod: nn.Module, args: object, out: object, i: int = 0) -> None:
            if off._pending.get((i + 1, False)) is not None:
                seen["forward"].append(i)

        def backward_hook(mod: nn.Module, grads: object, i: int = 0) -> None:  # as unit i's backward ends
            # pass 0: no gradient on the drive yet; pass 1: the unit's gradients read with it
            if off._pending.get((i - 1, bool(seen["backward"]) and len(seen["backward"]) >= 3)) is not None:
                seen["backward"].append(i)

        for i, u in enumerate(units):
            u.register_forward_hook(lambda mod, a, o, i=i: forward_hook(mod, a, o, i))
            u.register_full_backward_hook(lambda mod, gi, go, i=i: backward_hook(mod, gi, i))
        for s in range(2):
            loss("sequential", m, s, 0).backward()
        assert seen["forward"] == [0, 1, 2] * 2  # the last unit has no next one
        assert seen["backward"] == [3, 2, 1] * 2
        assert off.stats()["prefetched"] >= 10
