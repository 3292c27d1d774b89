"""Experts computed together (deepnvme.moe.grouped) and the dropless mode, against the per-expert loop.

The loop (``DEEPNVME_MOE_EXPERTS=loop``) is the reference: every other path must give its outputs, l_aux,
counts and every gradient (input, gate, experts), exactly where the arithmetic is the same (one ``baddbmm``
per Linear over the padded buffer) and within rounding where it is not (torch's grouped mm adds the bias
after the product; rows that skip the padding are multiplied in other blocks).
"""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
from torch import nn

from deepnvme.moe import MoE
from deepnvme.moe.grouped import GroupedExperts, choose, describe, pack, stack_views
from tests.support.thread_helpers import run_threads

M, FFN = 32, 48


def _moe(seed: int = 0, dtype: torch.dtype = torch.float32, expert: nn.Module | None = None,
         **kw: Any) -> MoE:
    torch.manual_seed(seed)
    expert = expert if expert is not None else nn.Sequential(nn.Linear(M, FFN), nn.GELU(), nn.Linear(FFN, M))
    args: dict[str, Any] = {"num_experts": 4, "k": 1, "capacity_factor": 0.75, "min_capacity": 2,
                            "use_rts": False, "top2_2nd_expert_sampling": False}
    args.update(kw)
    moe = MoE(M, expert, **args).to(dtype)
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.mul_(4.0)  # uneven loads: some experts drop, some sit half empty
    return moe


def _step(monkeypatch: pytest.MonkeyPatch, impl: str, seed: int = 0, dtype: torch.dtype = torch.float32,
          tokens: int = 40, **kw: Any) -> dict[str, Any]:
    """Forward and backward of one layer built from ``seed`` with the experts computed by ``impl``."""
    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", impl)
    moe = _moe(seed, dtype, **kw)
    x = torch.randn(tokens, M, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).requires_grad_()
    out, l_aux, counts = moe(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    ((out * w).sum() + 0.1 * l_aux).backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return {"out": out.detach(), "l_aux": l_aux.detach(), "counts": counts, "x": x.grad,
            "grads": grads, "path": moe.deepspeed_moe.last_path}


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool, name: str) -> None:
    """Equal bits; else fp32 within 1e-5, bf16 within 2% of the tensor's norm (one bf16 rounding here and
    there, which a sum over rows carries into a gradient)."""
    if exact:
        assert torch.equal(a, b), name
    elif a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    else:
        err = (a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-6)
        assert err <= 2e-2, f"{name}: relative error {err:.3g}"


def _same(a: dict[str, Any], b: dict[str, Any], exact: bool, dtype: torch.dtype) -> None:
    assert torch.equal(a["counts"], b["counts"])
    for key in ("l_aux", "out", "x"):
        _close(a[key], b[key], exact, key)
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        _close(a["grads"][name], b["grads"][name], exact, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,drop", [(1, True), (2, True), (2, False), (3, True)])
def test_grouped_paths_equal_the_loop(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, k: int,
                                      drop: bool) -> None:
    ref = _step(monkeypatch, "loop", dtype=dtype, k=k, drop_tokens=drop)
    assert "loop" in ref["path"]
    bmm = _step(monkeypatch, "bmm", dtype=dtype, k=k, drop_tokens=drop)
    assert bmm["path"] == "padded, bmm"
    # One baddbmm per Linear: the loop's bits for shapes like these (torch takes other kernels for tiny
    # matrices, so it is not promised).
    _same(bmm, ref, exact=dtype == torch.float32, dtype=dtype)
    for impl in ("segments", "grouped_mm"):  # the kept rows only: other row counts, so within rounding
        got = _step(monkeypatch, impl, dtype=dtype, k=k, drop_tokens=drop)
        assert got["path"] == f"rows, {impl}"
        _same(got, ref, exact=False, dtype=dtype)


@pytest.mark.parametrize("impl", ["loop", "segments", "bmm", "grouped_mm"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_dropless_keeps_every_route_and_equals_the_padded_no_drop_layer(monkeypatch: pytest.MonkeyPatch,
                                                                        impl: str, k: int) -> None:
    """Dropless computes only the routed rows; the same assignment padded to the largest expert (DeepSpeed's
    drop_tokens=False) through the loop gives the same numbers."""
    ref = _step(monkeypatch, "loop", k=k, drop_tokens=False)
    got = _step(monkeypatch, impl, k=k, dropless=True)
    assert got["path"] == f"rows, {impl}"
    assert int(got["counts"].sum()) == 40 * k
    _same(got, ref, exact=False, dtype=torch.float32)


ACTIVATIONS = {"gelu": nn.GELU(), "gelu-tanh": nn.GELU(approximate="tanh"), "silu": nn.SiLU(),
               "sigmoid": nn.Sigmoid(), "tanh": nn.Tanh(), "relu": nn.ReLU(), "leaky": nn.LeakyReLU(0.1)}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3])
def test_segments_are_the_loop_over_the_same_rows_bit_for_bit(monkeypatch: pytest.MonkeyPatch, act: str,
                                                              dtype: torch.dtype, k: int) -> None:
    """Dropless through segments makes the same BLAS calls on the same rows as each expert's Linear, and
    applies an activation whose last bits depend on an element's place (SiLU, sigmoid, GELU...) to each
    expert's rows on their own, as the expert's own call does. Widths 21 and 13: vector tails everywhere."""

    def expert() -> nn.Module:
        return nn.Sequential(nn.Linear(M, 21), ACTIVATIONS[act], nn.Linear(21, M))

    ref = _step(monkeypatch, "loop", dtype=dtype, k=k, dropless=True, tokens=37, expert=expert())
    got = _step(monkeypatch, "segments", dtype=dtype, k=k, dropless=True, tokens=37, expert=expert())
    assert got["path"] == "rows, segments"
    _same(got, ref, exact=True, dtype=dtype)


def test_dropless_ignores_capacity_and_drop_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPNVME_MOE_EXPERTS", raising=False)
    moe = _moe(num_experts=4, k=2, capacity_factor=0.1, min_capacity=0, drop_tokens=True, dropless=True)
    routes = moe.deepspeed_moe.gate.route(torch.randn(30, M))
    assert bool((routes.slot >= 0).all())
    out, _, _ = moe(torch.randn(30, M))
    assert bool((out.abs().sum(1) > 0).all())  # no token lost its experts


def test_empty_batch_and_idle_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    for impl in ("segments", "grouped_mm", "bmm", "loop"):
        monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", impl)
        for dropless in (False, True):
            moe = _moe(dropless=dropless)
            out, l_aux, counts = moe(torch.zeros(0, M, requires_grad=True))
            assert out.shape == (0, M) and int(counts.sum()) == 0
            (out.sum() + l_aux).backward()
            # One token: three of four experts idle; in training every expert still gets a gradient (zeros).
            moe.zero_grad(set_to_none=True)
            out, l_aux, _ = moe(torch.randn(1, M))
            (out.sum() + l_aux).backward()
            assert all(p.grad is not None for p in moe.deepspeed_moe.experts.parameters())


def test_what_is_not_grouped_runs_through_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPNVME_MOE_EXPERTS", raising=False)
    x = torch.randn(20, M)

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(M, M)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.fc(t) * 2

    class MySequential(nn.Sequential):
        pass

    cases = {
        "custom module": _moe(expert=Custom()),
        "Sequential subclass": _moe(expert=MySequential(nn.Linear(M, M), nn.ReLU())),
        "unknown activation": _moe(expert=nn.Sequential(nn.Linear(M, M), nn.Softplus())),
        "dropout in training": _moe(expert=nn.Sequential(nn.Linear(M, M), nn.Dropout(0.5))).train(),
    }
    hooked = _moe()
    hooked.deepspeed_moe.experts.deepspeed_experts[2][0].register_forward_hook(lambda *a: None)
    cases["hook inside an expert"] = hooked
    for name, moe in cases.items():
        moe(x)
        assert "loop" in moe.deepspeed_moe.last_path, name
    # dropout that does nothing (eval, or p = 0) is grouped; so is a lone Linear
    for moe in (_moe(expert=nn.Sequential(nn.Linear(M, M), nn.Dropout(0.5))).eval(),
                _moe(expert=nn.Sequential(nn.Linear(M, M), nn.Dropout(0.0))), _moe(expert=nn.Linear(M, M))):
        with torch.no_grad():
            moe(x)
        assert "loop" not in moe.deepspeed_moe.last_path
    # autocast: the loop, where torch decides each Linear's dtype
    moe = _moe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert "loop" in moe.deepspeed_moe.last_path


def test_pr_moe_residual_grouped_equals_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _step(monkeypatch, "loop", k=2, use_residual=True)
    got = _step(monkeypatch, "segments", k=2, use_residual=True)
    _same(got, ref, exact=False, dtype=torch.float32)


def test_packed_model_saves_each_expert_once(tmp_path: Any) -> None:
    import deepnvme

    moe = _moe()
    deepnvme.save(moe.state_dict(), tmp_path / "packed.pt")
    deepnvme.save({k: v.clone() for k, v in moe.state_dict().items()}, tmp_path / "cloned.pt")
    assert (tmp_path / "packed.pt").stat().st_size <= (tmp_path / "cloned.pt").stat().st_size * 1.05
    loaded = deepnvme.load(tmp_path / "packed.pt")
    assert all(torch.equal(loaded[k], v) for k, v in moe.state_dict().items())


def test_parameters_are_packed_and_stay_packed() -> None:
    moe = _moe()
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    weights = [e[0].weight for e in experts]
    assert stack_views(weights) is not None
    params_before = [id(p) for p in moe.parameters()]
    moe.double()
    assert stack_views([e[0].weight for e in experts]) is not None
    assert [id(p) for p in moe.parameters()] == params_before  # optimisers keep their parameters
    # values survive packing: a state dict round trip through torch.save gives the same tensors
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    buf = io.BytesIO()
    torch.save(moe.state_dict(), buf)
    size = buf.tell()
    fresh = _moe(seed=9).double()
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    # the model's file holds each expert once (shared storage written once)
    unpacked = io.BytesIO()
    torch.save(state, unpacked)
    assert size <= unpacked.tell() * 1.05


def test_packing_survives_share_memory_and_comes_back_after_deepcopy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing serves the paths that multiply stacked weights (bmm, torch's grouped mm)."""
    import copy

    from deepnvme.moe.grouped import is_packed

    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", "bmm")
    moe = _moe()
    experts = moe.deepspeed_moe.experts
    moe.share_memory()
    assert is_packed(experts.deepspeed_experts)
    assert all(p.is_shared() for p in experts.parameters())  # not re-packed into private memory
    twin = copy.deepcopy(moe)
    assert not is_packed(twin.deepspeed_moe.experts.deepspeed_experts)  # torch's deepcopy clones each
    x = torch.randn(20, M)
    assert torch.equal(twin(x)[0], moe(x)[0])
    assert is_packed(twin.deepspeed_moe.experts.deepspeed_experts)  # packed again by its first forward


def test_grouped_mm_probe_runs_under_no_grad() -> None:
    from deepnvme.moe import grouped

    grouped._grouped_mm_works.cache_clear()
    with torch.inference_mode():
        works = grouped._grouped_mm_works("cpu", torch.float32)
    assert works == grouped._grouped_mm_works.__wrapped__("cpu", torch.float32)
    assert works[0] == (grouped._grouped_mm() is not None)


def test_pack_refuses_what_it_cannot_stack() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 5)
    assert not pack([a, b])
    assert not pack([nn.Linear(4, 4)])
    c, d = nn.Linear(4, 4), nn.Linear(4, 4).double()
    assert not pack([c, d])
    e, f = nn.Linear(4, 4), nn.Linear(4, 4)
    before = (e.weight.clone(), f.weight.clone())
    assert pack([e, f]) and torch.equal(e.weight, before[0]) and torch.equal(f.weight, before[1])


def test_unpacked_experts_are_stacked_by_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user who replaces a parameter breaks the pack: the grouped path copies, and stays correct."""
    ref = _step(monkeypatch, "loop", k=2)
    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", "segments")
    moe = _moe(k=2)
    with torch.no_grad():
        first = moe.deepspeed_moe.experts.deepspeed_experts[0][0]
        first.weight = nn.Parameter(first.weight.clone())
    assert stack_views([e[0].weight for e in moe.deepspeed_moe.experts.deepspeed_experts]) is None
    x = torch.randn(40, M, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, l_aux, _ = moe(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    ((out * w).sum() + 0.1 * l_aux).backward()
    torch.testing.assert_close(out.detach(), ref["out"], rtol=1e-5, atol=1e-6)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, ref["grads"][n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_plan_refuses_what_it_does_not_compute() -> None:
    """GroupedExperts.run takes the choices that multiply the experts together; another (the loop, a typo)
    is a ValueError naming it (it ran torch's grouped mm)."""
    plan = GroupedExperts.of([nn.Linear(M, M) for _ in range(2)])
    assert plan is not None
    for impl in ("loop", "fast"):
        with pytest.raises(ValueError, match=f"impl: experts computed together by '{impl}'"):
            plan.run(torch.randn(3, M), [1, 2], impl)


def test_choice_is_reported_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPNVME_MOE_EXPERTS", raising=False)
    line = describe()
    assert line.startswith("cpu: float32 segments, bfloat16 segments, float16 segments, torch grouped mm ")
    assert choose(torch.device("cpu"), torch.float32) == "segments"
    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", "bmm")
    assert choose(torch.device("cpu"), torch.float32) == "bmm"
    assert "forced" in describe()
    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", "fast")
    with pytest.raises(ValueError, match="DEEPNVME_MOE_EXPERTS"):
        choose(torch.device("cpu"), torch.float32)


def test_run_checks_counts() -> None:
    plan = GroupedExperts.of([nn.Linear(8, 8), nn.Linear(8, 8)])
    assert plan is not None
    with pytest.raises(ValueError, match="counts"):
        plan.run(torch.randn(5, 8), [2, 2], "grouped_mm")
    assert GroupedExperts.of([nn.Linear(8, 8), nn.Linear(8, 16)]) is None
    assert GroupedExperts.of([nn.Sequential(nn.ReLU())]) is None  # no Linear: nothing to group


def test_grouped_mm_backward_takes_an_expanded_gradient() -> None:
    """A sum() loss hands the product an expanded (stride-0) gradient, which torch's CPU grouped mm
    refuses; the plan makes it dense first. The same gradients as the loop."""
    torch.manual_seed(0)
    experts = [nn.Linear(16, 16) for _ in range(3)]
    plan = GroupedExperts.of(experts)
    assert plan is not None
    x = torch.randn(10, 16, requires_grad=True)
    plan.run(x, [3, 4, 3], "grouped_mm").sum().backward()
    got = [x.grad.clone(), *(p.grad.clone() for e in experts for p in e.parameters())]
    x.grad = None
    for e in experts:
        e.zero_grad(set_to_none=True)
    torch.cat([e(part) for e, part in zip(experts, x.split([3, 4, 3]))]).sum().backward()
    want = [x.grad, *(p.grad for e in experts for p in e.parameters())]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unaligned_widths_fall_back_to_bmm_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's grouped mm wants 16-byte row strides: a width of 5 floats takes the padded-rows route."""
    ref = _step(monkeypatch, "loop", k=2, expert=nn.Sequential(nn.Linear(M, 5), nn.ReLU(), nn.Linear(5, M)))
    got = _step(monkeypatch, "grouped_mm", k=2,
                expert=nn.Sequential(nn.Linear(M, 5), nn.ReLU(), nn.Linear(5, M)))
    _same(got, ref, exact=False, dtype=torch.float32)


@pytest.mark.parametrize("hidden", [5, 7, 21])
@pytest.mark.parametrize("bias", [True, False])
def test_segments_are_the_loop_for_odd_widths_and_without_bias(monkeypatch: pytest.MonkeyPatch, hidden: int,
                                                                bias: bool) -> None:
    """Rows of 5, 7 or 21 floats start off a 64-byte boundary: segments passes the slices the loop passes
    as they are and copies the rest to fresh memory, as the loop's own tensors are; experts without biases
    are grouped too."""

    def run(impl: str) -> tuple[Any, ...]:
        monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", impl)
        torch.manual_seed(3)
        expert = nn.Sequential(nn.Linear(hidden, 9, bias=bias), nn.SiLU(), nn.Linear(9, hidden, bias=bias))
        moe = MoE(hidden, expert, num_experts=3, k=2, dropless=True, top2_2nd_expert_sampling=False)
        x = torch.randn(11, hidden, generator=torch.Generator().manual_seed(4), requires_grad=True)
        out, l_aux, _ = moe(x)
        (out.square().sum() + l_aux).backward()
        return moe.deepspeed_moe.last_path, out.detach(), x.grad, [p.grad for p in moe.parameters()]

    ref, got = run("loop"), run("segments")
    assert got[0] == "rows, segments" and ref[0] == "rows, loop"
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert all(torch.equal(a, b) for a, b in zip(got[3], ref[3]))


def test_changed_experts_fall_back_or_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a user changes after construction is seen: an activation's setting or a parameter's shape
    changed in place sends the layer through the loop (the same numbers as the loop), a module declared by
    grouped_steps that is not the expert's own is refused, a state dict assigned twice is packed again."""
    monkeypatch.delenv("DEEPNVME_MOE_EXPERTS", raising=False)
    from deepnvme.moe.grouped import is_packed

    x = torch.randn(20, M)
    moe = _moe(expert=nn.Sequential(nn.Linear(M, FFN), nn.LeakyReLU(0.1), nn.Linear(FFN, M)))
    with torch.no_grad():
        moe(x)
    assert moe.deepspeed_moe.last_path == "rows, segments"
    moe.deepspeed_moe.experts.deepspeed_experts[1][1].negative_slope = 0.5
    with torch.no_grad():
        moe(x)
    assert "loop" in moe.deepspeed_moe.last_path
    wide = _moe()
    with torch.no_grad():
        wide.deepspeed_moe.experts.deepspeed_experts[1][0].weight = nn.Parameter(torch.randn(FFN + 8, M))
    with pytest.raises(RuntimeError, match="size"):  # the expert itself no longer fits its next Linear
        wide(x)
    assert wide.deepspeed_moe.experts.grouped(x) is None  # the loop raised it: no plan takes these experts

    shared = nn.Linear(M, M)

    class Borrowing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(M, M)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.fc(t)

        def grouped_steps(self) -> list[Any]:
            return [shared]  # not the expert's own Linear: grouping it would be wrong

    borrowing = _moe(expert=Borrowing())
    borrowing(x)
    assert "loop" in borrowing.deepspeed_moe.last_path

    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", "grouped_mm")  # a path that multiplies stacked weights
    moe = _moe()
    for _ in range(2):
        moe.load_state_dict({k: v.clone() for k, v in moe.state_dict().items()}, assign=True)
        assert not is_packed(moe.deepspeed_moe.experts.deepspeed_experts)
        with torch.inference_mode():  # packed again inside an inference forward: still trainable
            moe(x)
        assert is_packed(moe.deepspeed_moe.experts.deepspeed_experts)
        assert not any(p.is_inference() for p in moe.parameters())
        out, l_aux, _ = moe(x.requires_grad_())
        (out.sum() + l_aux).backward()


def test_threads_share_a_grouped_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads run the same layer at once (its plan made by whichever comes first, one after a
    deepcopy that re-packs inside a forward): every output is the one a single thread computes."""
    import copy

    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", "grouped_mm")  # the path that re-packs
    moe = copy.deepcopy(_moe(k=2)).eval()
    xs = [torch.randn(25, M, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with torch.no_grad():
        want = [copy.deepcopy(moe)(x)[0] for x in xs]
    got: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        with torch.no_grad():
            for j in range(i, len(xs), 4):
                got[j] = moe(xs[j])[0]

    run_threads([functools.partial(work, i) for i in range(4)], timeout=60)
    assert all(torch.equal(got[j], want[j]) for j in range(len(xs)))


def test_row_exchange_checks_its_counts() -> None:
    from deepnvme.moe.comm import all_to_all_rows, exchange_counts

    x = torch.randn(5, 4)
    assert all_to_all_rows(x, [5], [5], None) is x
    with pytest.raises(ValueError, match="send/recv must give 1 row counts"):
        all_to_all_rows(x, [4], [5], None)
    with pytest.raises(ValueError, match="send/recv"):
        all_to_all_rows(x, [3, 2], [5], None)
    counts = torch.tensor([[2, 3]])
    assert exchange_counts(counts, None) is counts
