"""offload_parameters under the ways people use a model beyond a plain forward and backward: a unit's input
or output also used outside it, requires_grad changed after the offload, gradient hooks on parameters,
torch.func.functional_call. Each gives what the same code gives in memory, bit for bit, or a clear error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from deepnvme.offload import OffloadedOptimizer, StreamedWeightError
from deepnvme.offload.train import offload_parameters
from tests.offload.train_models import build, loss, units_of

BUDGET = 4 << 20
OPT_BUDGET = 8 << 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.tanh(self.lin(x)))


class Residual(nn.Module):
    """Blocks that use their input twice, joined by a residual outside them, with an auxiliary loss on the
    first block's output: gradients of a unit's input and output arrive from inside and outside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(x)
        first = None
        for b in self.blocks:
            out = b(h) * h
            first = out if first is None else first
            h = h + out
        return self.head(h), first


def _residual_loss(m: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    out, first = m(x)
    return ((out - y) ** 2).mean() + 0.1 * first.pow(2).mean()


def _same_training(make: Callable[[], nn.Module], step_loss: Callable[[nn.Module, int], torch.Tensor],
                   workdir: Path, steps: int = 5, units: Callable[[nn.Module], object] = lambda m: None,
                   between: Callable[[nn.Module, int], None] = lambda m, s: None,
                   optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW) -> None:
    """`steps` steps (AdamW by default) in memory and offloaded (`between(model, step)` run before each)
    are equal."""
    ref, m = make(), make()
    ref_opt = optimizer(ref.parameters(), lr=1e-2)
    want, got = [], []
    with offload_parameters(m, workdir, BUDGET, units=units(m)), \
            OffloadedOptimizer(optimizer(m.parameters(), lr=1e-2), workdir, OPT_BUDGET) as opt:
        for net, o, out in ((ref, ref_opt, want), (m, opt, got)):
            for s in range(steps):
                between(net, s)
                la = step_loss(net, s)
                la.backward()
                o.step()
                o.zero_grad()
                out.append(la.detach())
    assert all(torch.equal(a, b) for a, b in zip(want, got)), [(a.item(), b.item())
                                                                for a, b in zip(want, got)]
    for (name, a), b in zip(ref.named_parameters(), m.parameters()):
        assert torch.equal(a, b), name


def test_inputs_and_outputs_also_used_outside_their_unit_are_bit_identical(workdir: Path) -> None:
    """Gradients reaching a unit's input from inside and outside it are summed in the order they have in
    memory (the end of a unit's backward is seen by a hook, not a node added to the graph)."""
    _same_training(Residual, _residual_loss, workdir, units=lambda m: list(m.blocks))


def test_an_auxiliary_loss_on_hidden_states_is_bit_identical(workdir: Path) -> None:
    pytest.importorskip("transformers", reason="the offload extra (transformers) is needed")

    def step_loss(m: nn.Module, s: int) -> torch.Tensor:
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(s))
        torch.manual_seed(s)
        out = m(input_ids=ids, labels=ids, output_hidden_states=True)
        return out.loss + 0.01 * sum(h.pow(2).mean() for h in out.hidden_states[1:-1])

    _same_training(lambda: build("gpt2"), step_loss, workdir)


def test_requires_grad_changed_after_the_offload_is_followed(workdir: Path) -> None:
    """Staged fine-tuning: a block frozen at the offload and unfrozen later gets gradients and steps, one
    frozen later gets none, as in memory; close() gives the parameters the flag last set."""
    def make() -> nn.Module:
        m = build("sequential")
        m[1].requires_grad_(False)
        return m

    def between(m: nn.Module, s: int) -> None:
        if s == 2:
            m[1].requires_grad_(True)
            m[4].weight.requires_grad = False

    _same_training(make, lambda m, s: loss("sequential", m, s, 0), workdir, units=lambda m: units_of(
        "sequential", m), between=between)


def test_unfreezing_beyond_the_budget_is_refused_with_the_number(workdir: Path) -> None:
    m = build("sequential")
    m[1].requires_grad_(False)
    need = m[1].weight.numel() * 4 + 4096  # the weight rounded to pages, and its bias's page
    with offload_parameters(m, workdir, need, units=[m[1]]):
        loss("sequential", m, 0, 0).backward()
        m[1].requires_grad_(True)
        with pytest.raises(ValueError, match=rf"unit '1' now needs {2 * need} bytes.*budget_bytes={need}"):
            loss("sequential", m, 0, 0)


def test_gradient_hooks_on_offloaded_parameters_run(workdir: Path) -> None:
    """register_hook on a parameter (a stand-in between uses) sees and may replace each gradient, as in
    memory; a hook handed the parameter itself is refused with the reason."""
    seen: list[str] = []

    def hook_all(m: nn.Module, s: int) -> None:
        if s == 0:
            for name, p in m.named_parameters():
                p.register_hook(lambda g, name=name: (seen.append(name), g * 0.5)[1])

    _same_training(lambda: build("sequential"), lambda m, s: loss("sequential", m, s, 0), workdir,
                   units=lambda m: units_of("sequential", m), between=hook_all)
    assert seen.count("1.weight") == 10  # five steps, in memory and offloaded
    m = build("sequential")
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        with pytest.raises(RuntimeError, match=r"post_accumulate_grad_hook on 1\.weight.*register_hook"):
            m[1].weight.register_post_accumulate_grad_hook(lambda p: None)


def test_functional_call_uses_the_tensors_given(workdir: Path) -> None:
    ref, m = build("sequential"), build("sequential")
    given = {n: torch.randn_like(p) for n, p in ref.named_parameters()}
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        want = torch.func.functional_call(ref, given, (ids,))
        assert torch.equal(torch.func.functional_call(m, given, (ids,)), want)
        assert torch.equal(m(ids), ref(ids))  # its own parameters again afterwards


def test_an_optimizer_that_makes_its_state_when_made_works(workdir: Path) -> None:
    """Adagrad makes its state from the parameters' shapes when it is made (zeros_like of a stand-in reads
    no value, so it works), and the OffloadedOptimizer takes that state to the drive."""
    _same_training(lambda: build("sequential"), lambda m, s: loss("sequential", m, s, 0), workdir,
                   units=lambda m: units_of("sequential", m), optimizer=torch.optim.Adagrad)


class Shared(nn.Module):
    """ALBERT's shape (one block object repeated in the list) and a layer shared by blocks of their own."""

    def __init__(self, albert: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(8, 16)
        if albert:
            block = Block()
            self.blocks = nn.ModuleList([block, block, block])
        else:
            shared = nn.Linear(16, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), shared) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h), h


@pytest.mark.parametrize("albert", [True, False], ids=["one-block-repeated", "layer-shared-by-blocks"])
def test_modules_shared_across_blocks_are_bit_identical(albert: bool, workdir: Path) -> None:
    """A block repeated as one object is one unit run several times (its gradient summed over its runs
    through the drive in the order memory sums it); a layer shared by several units stays in memory."""
    _same_training(lambda: Shared(albert), _residual_loss, workdir)


def test_load_state_dict_writes_the_offloaded_values(workdir: Path) -> None:
    """load_state_dict on an offloaded model: offloaded values go to the drive, the rest as torch loads
    them; a shape that does not match is refused before anything is loaded."""
    ref, m = build("sequential"), build("sequential")
    nn.init.normal_(ref[1].weight)
    nn.init.normal_(ref[0].weight)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        bad = {**ref.state_dict(), "1.weight": torch.zeros(3, 3)}
        with pytest.raises(RuntimeError, match=r"1\.weight is \(3, 3\) in the state dict and \(64, 32\)"):
            m.load_state_dict(bad)
        assert not torch.equal(m[0].weight, ref[0].weight)  # nothing loaded
        assert not torch.equal(m(ids), ref(ids))
        assert str(m.load_state_dict(ref.state_dict())) == "<All keys matched successfully>"
        assert torch.equal(m(ids), ref(ids))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))


def test_conversions_are_refused_before_anything_changes(workdir: Path) -> None:
    import copy

    m = build("sequential")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        want = m(ids)
        with pytest.raises(StreamedWeightError, match=r"would change 1\.weight.*nothing was changed"):
            m.half()
        assert {p.dtype for p in m.parameters()} == {torch.float32}
        assert m.to("cpu") is m and m.float() is m  # conversions that change nothing work
        assert torch.equal(m(ids), want)
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copy.deepcopy(m)


def test_the_hooks_of_a_step_are_freed_with_its_graph(workdir: Path) -> None:
    """The gradient hooks put on units' inputs live as long as the step's graph: none is left after it
    (a hook holding the nodes it hangs on makes a cycle through C++ that Python cannot free, and memory
    grows every step)."""
    import gc
    import inspect

    from deepnvme.offload.train import unit_hooks

    code = next(c for c in unit_hooks._on_gradient.__code__.co_consts
                if inspect.iscode(c) and c.co_name == "hook")
    # one per node before which a unit's backward begins or ends: each block's input and output (the
    # residual around each block makes them all different nodes)

    def live() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if inspect.isfunction(o) and o.__code__ is code)

    m = Residual()
    with offload_parameters(m, workdir, BUDGET, units=list(m.blocks)), \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), workdir, OPT_BUDGET) as opt:
        for s in range(6):
            la = _residual_loss(m, s)
            if s == 0:
                assert live() == 2 * len(m.blocks), live()
            la.backward()
            opt.step()
            opt.zero_grad()
            del la
            assert live() == 0


def test_close_without_restoring_drops_the_values(workdir: Path) -> None:
    """close(restore=False), for a model larger than memory: the swap files go, the model refuses any
    use saying why; nothing is read back."""
    m = build("sequential")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    off = offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m))
    m(ids)
    reads = off.stats()["bytes_read"]
    off.close(restore=False)
    assert off.stats()["bytes_read"] == reads and not any(workdir.iterdir())
    with pytest.raises(RuntimeError, match="closed with restore=False"):
        m(ids)
    off.close()  # idempotent


def test_a_units_output_modified_in_place_is_bit_identical(workdir: Path) -> None:
    """h = block(h); h.mul_(0.9): the unit's outputs are the tensors its forward made (no view added)."""
    def step_loss(m: nn.Module, s: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(s)
        h = m.emb(torch.randn(4, 8, generator=g))
        for b in m.blocks:
            h = b(h)
            h.mul_(0.9)
        return m.head(h).pow(2).mean()

    _same_training(Residual, step_loss, workdir, units=lambda m: list(m.blocks))


def test_a_checkpoint_that_does_not_exist_is_named(workdir: Path) -> None:
    m = build("sequential")
    with pytest.raises(FileNotFoundError) as err:
        offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m), checkpoint=workdir / "no.pt")
    assert err.value.filename == str(workdir / "no.pt")


def test_misuses_that_would_be_silent_are_refused(workdir: Path) -> None:
    """`.data =` on an offloaded parameter (would change the stand-in only) and a step of an optimizer
    whose offload was closed since (would skip every parameter it had offloaded) raise, naming them."""
    m = build("sequential")
    off = offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m))
    opt = OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET)
    with pytest.raises(RuntimeError, match=r"3\.weight\.data = \.\.\..*load_state_dict"):
        m[3].weight.data = torch.zeros(5, 5)
    assert m[3].weight.shape == (64, 64)
    loss("sequential", m, 0, 0).backward()
    opt.step()
    off.close()
    loss("sequential", m, 1, 0).backward()
    with pytest.raises(RuntimeError, match="was offloaded by offload_parameters, which was closed since"):
        opt.step()
    opt.close()


def test_a_first_forward_in_inference_mode_does_not_spoil_training(workdir: Path) -> None:
    ref, m = build("sequential"), build("sequential")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m)):
        with torch.inference_mode():
            assert torch.equal(m(ids), ref(ids))
        loss("sequential", m, 0, 0).backward()
        loss("sequential", ref, 0, 0).backward()
        assert torch.equal(m[0].weight.grad, ref[0].weight.grad)


def test_a_second_backward_over_a_retained_graph_is_as_in_memory(workdir: Path) -> None:
    _same_training(lambda: build("sequential"), lambda m, s: _twice(loss("sequential", m, s, 0)), workdir,
                   units=lambda m: units_of("sequential", m))


def _twice(la: torch.Tensor) -> torch.Tensor:
    """backward(retain_graph=True) here, and the caller's backward after: gradients doubled."""
    la.backward(retain_graph=True)
    return la
