"""OffloadedOptimizer(step_in_backward=True) over offload_parameters: each unit stepped as its backward
completes, its gradients never written; bit-identical to the same training in memory stepped after the
backward, and the bytes a step moves are the parameters' alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepnvme.offload import OffloadedOptimizer
from deepnvme.offload.train import offload_parameters
from tests.offload.train_models import build, loss, train, units_of

BUDGET = 4 << 20
OPT_BUDGET = 8 << 20


def _train_stepping_in_backward(kind: str, m: torch.nn.Module, opt: OffloadedOptimizer, steps: int,
                                accumulate: int = 1) -> list[torch.Tensor]:
    """As train_models.train, with the units stepped in the last micro-batch's backward."""
    out = []
    for s in range(steps):
        for k in range(accumulate):
            opt.step_in_backward = k == accumulate - 1
            la = loss(kind, m, s, k)
            (la / accumulate).backward()
            out.append(la.detach())
        opt.step()
        opt.zero_grad()
    return out


def _run(kind: str, workdir: Path, *, dtype: torch.dtype = torch.float32, checkpointing: str = "none",
         accumulate: int = 1, steps: int = 8) -> None:
    if kind != "sequential":
        pytest.importorskip("transformers", reason="the offload extra (transformers) is needed")
    masters = dtype != torch.float32
    ref, m = build(kind, dtype, checkpointing), build(kind, dtype, checkpointing)
    inner = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_opt = (OffloadedOptimizer(inner, workdir / "ref", OPT_BUDGET, master_weights=True) if masters
               else inner)
    with offload_parameters(m, workdir, BUDGET, units=units_of(kind, m)), \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET,
                               master_weights=masters, step_in_backward=True) as opt:
        want = train(kind, ref, ref_opt, steps, accumulate)
        got = _train_stepping_in_backward(kind, m, opt, steps, accumulate)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), [(a.item(), b.item())
                                                                    for a, b in zip(want, got)]
    if masters:
        ref_opt.close()
    for (name, a), b in zip(ref.named_parameters(), m.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["sequential", "gpt2", "llama", "mixtral"])
def test_stepping_in_the_backward_is_bit_identical(kind: str, workdir: Path) -> None:
    _run(kind, workdir)


def test_with_gradient_accumulation_and_checkpointing(workdir: Path) -> None:
    _run("llama", workdir, accumulate=3, steps=4)
    _run("gpt2", workdir, checkpointing="reentrant", accumulate=2, steps=4)
    _run("gpt2", workdir, checkpointing="nonreentrant", steps=4)


def test_bf16_with_fp32_masters(workdir: Path) -> None:
    _run("llama", workdir, dtype=torch.bfloat16, steps=6)


def test_a_step_moves_only_the_parameters(workdir: Path) -> None:
    """With the step in the backward, a step reads each unit twice (forward, backward) and writes its
    parameters once; after the backward, it also writes its gradients and reads both for the step."""
    nbytes = 0
    moved = {}
    for on in (False, True):
        m = build("sequential")
        units = units_of("sequential", m)
        nbytes = sum(p.numel() * p.element_size() for u in units for p in u.parameters())
        with offload_parameters(m, workdir, BUDGET, units=units) as off, \
                OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET,
                                   step_in_backward=on) as opt:
            train("sequential", m, opt, 2)
            before = off.stats()
            train("sequential", m, opt, 1, start=2)
            after = off.stats()
            moved[on] = (after["bytes_read"] - before["bytes_read"],
                         after["bytes_written"] - before["bytes_written"])
    assert moved[True] == (2 * nbytes, nbytes)
    assert moved[False] == (4 * nbytes, 2 * nbytes)  # forward, backward, and the step's params + grads


def test_a_unit_run_twice_before_one_backward_waits_for_both(workdir: Path) -> None:
    """Two forwards summed into one loss: a unit's first backward to end has half its gradient, so it is
    not stepped then (its gradient goes to the drive) but when the second ends; a forward with autograd
    that is never backpropagated only makes its unit wait for step()."""
    ref, m = build("sequential"), build("sequential")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)), \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET,
                               step_in_backward=True) as opt:
        for net, o in ((ref, ref_opt), (m, opt)):
            for s in range(4):
                if s == 1:
                    loss("sequential", net, 99, 0)  # an evaluation that forgot torch.no_grad()
                (loss("sequential", net, s, 0) + loss("sequential", net, s, 1)).backward()
                o.step()
                o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))


def test_what_cannot_step_in_the_backward_is_refused(workdir: Path) -> None:
    m = build("sequential")
    with pytest.raises(ValueError, match="step_in_backward=True needs the parameters of one model"):
        OffloadedOptimizer(torch.optim.AdamW(m.parameters()), workdir, OPT_BUDGET, step_in_backward=True)
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        with pytest.raises(TypeError, match="element-wise optimizer.*AdamW is not one"):
            OffloadedOptimizer(torch.optim.AdamW(m.parameters()), workdir, OPT_BUDGET,
                               step_in_backward=True, elementwise=False)
        with OffloadedOptimizer(torch.optim.AdamW(m.parameters()), workdir, OPT_BUDGET,
                                step_in_backward=True) as first:
            with pytest.raises(ValueError, match="another OffloadedOptimizer steps this model"):
                OffloadedOptimizer(torch.optim.AdamW(m.parameters()), workdir, OPT_BUDGET,
                                   step_in_backward=True)
            with pytest.raises(TypeError, match="step_in_backward must be a bool"):
                first.step_in_backward = 1  # type: ignore[assignment]
        # closed: another may step it now
        OffloadedOptimizer(torch.optim.AdamW(m.parameters()), workdir, OPT_BUDGET,
                           step_in_backward=True).close()


class Checkpointed(torch.nn.Module):
    """Blocks run through torch.utils.checkpoint by the model itself (reentrant: the forward runs without
    autograd, the recompute inside the backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.emb = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(h).pow(2).mean()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])
def test_a_loss_of_two_checkpointed_forwards_is_stepped_once(reentrant: bool, workdir: Path) -> None:
    """The first of a unit's two backwards has half its gradient: the unit waits for the second, also when
    its forward ran without autograd (reentrant checkpointing)."""
    ref, m = Checkpointed(reentrant), Checkpointed(reentrant)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with offload_parameters(m, workdir, BUDGET, units=list(m.blocks)), \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), workdir, OPT_BUDGET,
                               step_in_backward=True) as opt:
        for net, o in ((ref, ref_opt), (m, opt)):
            for s in range(3):
                g = torch.Generator().manual_seed(s)
                (net(torch.randn(4, 8, generator=g)) + net(torch.randn(4, 8, generator=g))).backward()
                o.step()
                o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))


def test_an_optimizer_dropped_without_close_steps_nothing(workdir: Path) -> None:
    """The model points at the optimizer stepping it in backward weakly: dropped, it is collected (its
    files removed) and a new one takes over."""
    import gc

    m = build("sequential")
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        OffloadedOptimizer(torch.optim.AdamW(m.parameters()), workdir, OPT_BUDGET, step_in_backward=True)
        gc.collect()
        with OffloadedOptimizer(torch.optim.AdamW(m.parameters()), workdir, OPT_BUDGET,
                                step_in_backward=True) as opt:
            loss("sequential", m, 0, 0).backward()
            assert opt.last_step is None and len(opt._stepper.profiles) == 4  # the four units, stepped


def test_what_would_read_an_applied_gradient_raises(workdir: Path) -> None:
    """After a backward that stepped the units, their gradients are gone: a clip by the norm of all of
    them, or a second backward before zero_grad() (the flag left on within an accumulation), raises saying
    so instead of using the rest; zero_grad() and the next step go on."""
    from deepnvme.offload import StreamedWeightError

    m = build("sequential")
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)), \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET,
                               step_in_backward=True) as opt:
        loss("sequential", m, 0, 0).backward()
        with pytest.raises(StreamedWeightError, match=r"1\.weight\.grad was applied by the optimizer's step"):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        with pytest.raises(RuntimeError, match=r"gradient of 5\.weight was applied .*opt\.zero_grad\(\)"):
            loss("sequential", m, 0, 1).backward()
        opt.step()
        opt.zero_grad()
        train("sequential", m, opt, 1)


def test_modules_making_sparse_gradients_are_refused(workdir: Path) -> None:
    """offload_parameters writes dense gradients: a unit holding nn.Embedding(sparse=True) is refused up
    front, naming the parameter (torch's own error came at the end of the first backward)."""
    m = torch.nn.Sequential(torch.nn.Embedding(64, 256, sparse=True), torch.nn.Linear(256, 4))
    with pytest.raises(ValueError, match=r"0\.weight gets sparse gradients .*sparse=False"):
        offload_parameters(m, workdir, BUDGET, units=[m[0], m[1]])
    m[0].weight.requires_grad_(False)  # frozen: no gradient at all, taken
    with offload_parameters(m, workdir, BUDGET, units=[m[0], m[1]]):
        m[0].weight.requires_grad_(True)  # unfrozen after: its first backward says what torch's did not
        with pytest.raises(RuntimeError, match=r"0\.weight got a sparse gradient"):
            m(torch.tensor([1, 2])).sum().backward()
