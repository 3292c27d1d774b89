"""deepnvme.moe.routing: DeepSpeed's slot maths, the compiled op against the pure-torch path, bad inputs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepnvme.moe import routing
from deepnvme.moe.routing import (
    assign_slots,
    combine,
    combine_per_expert,
    dispatch,
    dispatch_per_expert,
    top_k,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("torch", "op")


@pytest.fixture(scope="session")
def moe_op() -> None:
    """The compiled op, built at most once per session; skipped with the build's reason where it cannot be."""
    ok, reason = routing.op_available()
    if not ok:
        pytest.skip(f"the moe op cannot be built here: {reason}")


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    """Each implementation in turn; the op one needs the compiled op."""
    if request.param == "op":
        request.getfixturevalue("moe_op")
    return request.param


def choices(num_tokens: int, num_experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct experts per token, as a gate's top-k gives them."""
    return torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)])


def expected_slots(idx: torch.Tensor, num_experts: int, capacity: int | None, priority: torch.Tensor | None,
                   rule: str) -> torch.Tensor:
    """DeepSpeed's gating formulas (moe_spec §3) with [S, E] masks: the slot of each route, -1 when dropped.

    rule "top1": mask of the first choice, per expert keep the top-`capacity` priorities, locations = cumsum.
    rule "top2": loc1 = cumsum(mask1)-1, loc2 = cumsum(mask2)-1 + count(mask1), drop loc >= capacity.
    rule "probs"/"position": topkgating's two drop policies over the [S, E] choice mask, locations = cumsum.
    """
    num_tokens, k = idx.shape
    masks = [F.one_hot(idx[:, j], num_experts) for j in range(k)]
    if rule == "top2":
        loc = [torch.cumsum(masks[0], 0) - 1, torch.cumsum(masks[1], 0) - 1 + masks[0].sum(0, keepdim=True)]
        if capacity is not None:
            masks = [m * (loc_j < capacity) for m, loc_j in zip(masks, loc)]
        return torch.stack([torch.where(m.any(1), (lj * m).sum(1), -1) for m, lj in zip(masks, loc)], 1)
    mask = sum(masks)
    if capacity is not None and rule in ("top1", "probs"):
        score = sum(m * priority[:, j:j + 1] for j, m in enumerate(masks))
        keep = torch.topk(score, min(capacity, num_tokens), dim=0).indices
        mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    loc = torch.cumsum(mask, 0) - 1
    if capacity is not None and rule == "position":
        mask = mask * (loc < capacity)
    out = torch.full((num_tokens, k), -1, dtype=torch.long)
    for j in range(k):
        kept = mask.gather(1, idx[:, j:j + 1]).squeeze(1).bool()
        out[:, j] = torch.where(kept, loc.gather(1, idx[:, j:j + 1]).squeeze(1), -1)
    return out


# ------------------------------------------------------------------------------------ DeepSpeed's slot maths
@pytest.mark.parametrize("capacity", [None, 0, 3, 7, 100])
def test_slots_follow_deepspeeds_gating_formulas(impl: str, capacity: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_experts = 40, 5
    rules = [(1, "top1", True), (1, "top1", False), (2, "top2", False), (3, "probs", True),
             (4, "position", False), (3, "probs", False)]
    for k, rule, use_priority in rules:
        idx = choices(num_tokens, num_experts, k, gen)
        priority = torch.rand(num_tokens, k, generator=gen) if use_priority else None
        ref_rule = "position" if rule in ("top1", "probs") and priority is None else rule
        if capacity is None and rule != "top2":
            ref_rule = "position"
        expected = expected_slots(idx, num_experts, capacity, priority, ref_rule)
        slot, counts = assign_slots(idx, num_experts, capacity, priority, impl=impl)
        assert torch.equal(slot, expected), (k, rule, use_priority)
        assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=num_experts))


def test_top2_order_by_hand(impl: str) -> None:
    # Expert 0 is the first choice of tokens 1 and 3, the second of tokens 0 and 2: first choices first.
    idx = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 2]])
    slot, counts = assign_slots(idx, 3, 3, impl=impl)
    assert slot.tolist() == [[0, 2], [0, 2], [1, -1], [1, 0]]
    assert counts.tolist() == [4, 3, 1]
    token_major, _ = assign_slots(idx, 3, 3, order="token", impl=impl)
    assert token_major.tolist() == [[0, 0], [1, 1], [2, 2], [-1, 0]]


def test_priority_keeps_the_best_and_numbers_them_in_slot_order(impl: str) -> None:
    idx = torch.zeros(6, 1, dtype=torch.long)
    priority = torch.tensor([[0.1], [0.9], [0.5], [0.9], [0.2], [0.7]])
    slot, counts = assign_slots(idx, 2, 3, priority, impl=impl)
    assert slot.squeeze(1).tolist() == [-1, 0, -1, 1, -1, 2]
    assert counts.tolist() == [6, 0]
    # DeepSpeed's top-1 without RTS keeps the last C tokens: a rising priority says exactly that.
    last, _ = assign_slots(idx, 2, 2, torch.arange(6.0).unsqueeze(1), impl=impl)
    assert last.squeeze(1).tolist() == [-1, -1, -1, -1, 0, 1]
    ties, _ = assign_slots(idx, 2, 2, torch.ones(6, 1), impl=impl)  # ties go to the earlier route
    assert ties.squeeze(1).tolist() == [0, 1, -1, -1, -1, -1]


def test_active_routes_only(impl: str) -> None:
    idx = torch.tensor([[0], [0], [1], [0]])
    slot, counts = assign_slots(idx, 2, 1, active=torch.tensor([False, True, True, True]), impl=impl)
    assert slot.squeeze(1).tolist() == [-1, 0, 0, -1] and counts.tolist() == [2, 1]


def test_empty_inputs_and_idle_experts(impl: str) -> None:
    slot, counts = assign_slots(torch.zeros(0, 2, dtype=torch.long), 4, 3, impl=impl)
    assert slot.shape == (0, 2) and counts.tolist() == [0, 0, 0, 0]
    out = dispatch(torch.zeros(0, 5), torch.zeros(0, 2, dtype=torch.long), slot, 4, 3, impl=impl)
    assert out.shape == (4, 3, 5) and not out.any()
    y = torch.randn(4, 3, 5)
    assert combine(y, torch.zeros(0, 2, dtype=torch.long), slot, torch.zeros(0, 2), impl=impl).shape == (0, 5)


# ------------------------------------------------------------------------------------ top_k
@pytest.mark.parametrize("num_experts", [1, 5, 64])
def test_top_k_orders_largest_first_with_ties_to_the_lower_index(impl: str, num_experts: int) -> None:
    gen = torch.Generator().manual_seed(num_experts)
    scores = torch.randint(0, 4, (50, num_experts), generator=gen).float()  # many ties
    for k in sorted({1, min(2, num_experts), num_experts}):
        values, indices = top_k(scores, k, impl=impl)
        ref = torch.sort(scores, dim=1, descending=True, stable=True)
        assert torch.equal(indices, ref.indices[:, :k]) and torch.equal(values, ref.values[:, :k])
    assert torch.equal(top_k(scores, 1, impl=impl)[1].squeeze(1), torch.argmax(scores, dim=1))
    real = torch.randn(50, num_experts, generator=gen)
    k = min(3, num_experts)
    assert torch.equal(top_k(real, k, impl=impl)[1], torch.topk(real, k, dim=1).indices)


def test_top_k_values_carry_the_gradient(impl: str) -> None:
    scores = torch.randn(6, 4, requires_grad=True)
    values, indices = top_k(scores, 2, impl=impl)
    values.sum().backward()
    expected = torch.zeros(6, 4).scatter_(1, indices, 1.0)
    assert torch.equal(scores.grad, expected)


# ------------------------------------------------------------------------------------ op == torch
CASES = [(k, capacity, prio, act) for k in (1, 2, 4) for capacity in (None, 0, 2, 9, 500)
         for prio in (False, True) for act in (False, True)]


@pytest.mark.parametrize("k,capacity,use_priority,use_active", CASES)
def test_op_assigns_exactly_as_the_reference(moe_op: None, k: int, capacity: int | None, use_priority: bool,
                                             use_active: bool) -> None:
    gen = torch.Generator().manual_seed(k * 1000 + (capacity or 0))
    num_tokens, num_experts = 120, 12  # a few of the 12 experts get nothing when k=1
    idx = choices(num_tokens, num_experts, k, gen) % (num_experts - 3)
    # Later choices may repeat the first one: assign_slots does not require distinct experts per token.
    idx = torch.where(torch.arange(k) == 0, idx, choices(num_tokens, num_experts, k, gen))
    priority = torch.randint(0, 4, (num_tokens, k), generator=gen).float() if use_priority else None  # ties
    active = torch.rand(num_tokens, generator=gen) > 0.2 if use_active else None
    for order in ("choice", "token"):
        got = assign_slots(idx, num_experts, capacity, priority, order=order, active=active, impl="op")
        ref = assign_slots(idx, num_experts, capacity, priority, order=order, active=active, impl="torch")
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), order


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_tokens=st.integers(0, 40), num_experts=st.integers(1, 9), k=st.integers(1, 4),
       capacity=st.one_of(st.none(), st.integers(0, 50)), use_priority=st.booleans(),
       order=st.sampled_from(("choice", "token")), seed=st.integers(0, 2**16))
def test_slot_invariants_and_op_equality(moe_op: None, num_tokens: int, num_experts: int, k: int,
                                         capacity: int | None, use_priority: bool, order: str,
                                         seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num_experts, (num_tokens, k), generator=gen)
    priority = torch.randint(0, 3, (num_tokens, k), generator=gen).float() if use_priority else None
    slot, counts = assign_slots(idx, num_experts, capacity, priority, order=order, impl="torch")
    op_slot, op_counts = assign_slots(idx, num_experts, capacity, priority, order=order, impl="op")
    assert torch.equal(slot, op_slot) and torch.equal(counts, op_counts)
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=num_experts))
    for e in range(num_experts):
        taken = sorted(slot[(idx == e) & (slot >= 0)].tolist())
        limit = int(counts[e]) if capacity is None else min(int(counts[e]), capacity)
        assert taken == list(range(limit))  # compact, unique, as many as fit
    x = torch.randn(num_tokens, 3, generator=gen)
    cap = int(slot.max()) + 1 if slot.numel() else 0
    assert torch.equal(dispatch(x, idx, slot, num_experts, cap, impl="op"),
                       dispatch(x, idx, slot, num_experts, cap, impl="torch"))


def dense_reference(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, slot: torch.Tensor,
                    weight: torch.Tensor, num_experts: int,
                    capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed's legacy dense path: an [S, E, C] combine tensor and two einsums (tiny sizes only)."""
    sec = torch.zeros(x.shape[0], num_experts, capacity, dtype=torch.float64)
    for s, j in (slot >= 0).nonzero().tolist():
        sec[s, idx[s, j], slot[s, j]] += weight[s, j].double()
    return (torch.einsum("sec,sm->ecm", (sec > 0).double(), x.double()),
            torch.einsum("sec,ecm->sm", sec, y.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_dispatch_combine_match_each_other_and_the_dense_einsum(moe_op: None, dtype: torch.dtype,
                                                                k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    num_tokens, num_experts, width = 64, 6, 24
    capacity = 13
    idx = choices(num_tokens, num_experts, k, gen)
    slot, _ = assign_slots(idx, num_experts, capacity, torch.rand(num_tokens, k, generator=gen))
    x0 = torch.randn(num_tokens, width, generator=gen).to(dtype)
    y0 = torch.randn(num_experts, capacity, width, generator=gen).to(dtype)
    w0 = torch.rand(num_tokens, k, generator=gen)
    g_out = torch.randn(num_tokens, width, generator=gen).to(dtype)
    g_disp = torch.randn(num_experts, capacity, width, generator=gen).to(dtype)
    results = {}
    for impl in IMPLS:
        x, y, w = (t.clone().requires_grad_() for t in (x0, y0, w0))
        d = dispatch(x, idx, slot, num_experts, capacity, impl=impl)
        o = combine(y, idx, slot, w, impl=impl)
        torch.autograd.backward([d, o], [g_disp, g_out])
        results[impl] = (d.detach(), o.detach(), x.grad, y.grad, w.grad)
    (d_op, o_op, gx_op, gy_op, gw_op), (d_t, o_t, gx_t, gy_t, gw_t) = results["op"], results["torch"]
    assert d_op.dtype == dtype and o_op.dtype == dtype
    assert torch.equal(d_op, d_t) and torch.equal(o_op, o_t) and torch.equal(gy_op, gy_t)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(gx_op, gx_t, **tol)
    torch.testing.assert_close(gw_op, gw_t, rtol=1e-4, atol=1e-4 if dtype == torch.float32 else 1e-2)
    dense_d, dense_o = dense_reference(x0, y0, idx, slot, w0, num_experts, capacity)
    assert torch.equal(d_op.double(), dense_d)
    torch.testing.assert_close(o_op.double(), dense_o, **tol)


def test_torch_path_passes_gradcheck() -> None:
    gen = torch.Generator().manual_seed(5)
    idx = choices(12, 4, 2, gen)
    slot, _ = assign_slots(idx, 4, 5, impl="torch")
    x = torch.randn(12, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(4, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(12, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: dispatch(a, idx, slot, 4, 5, impl="torch"), (x,))
    assert torch.autograd.gradcheck(lambda b, c: combine(b, idx, slot, c, impl="torch"), (y, w))


def test_op_gradients_are_the_analytic_ones(moe_op: None) -> None:
    """Finite differences in float32 are too coarse, so check the op's backward against the chain rule."""
    gen = torch.Generator().manual_seed(6)
    idx = choices(30, 5, 2, gen)
    slot, _ = assign_slots(idx, 5, 8)
    y = torch.randn(5, 8, 4, generator=gen, requires_grad=True)
    w = torch.rand(30, 2, generator=gen, requires_grad=True)
    g = torch.randn(30, 4, generator=gen)
    combine(y, idx, slot, w, impl="op").backward(g)
    for s, j in (slot >= 0).nonzero().tolist():
        row = y[idx[s, j], slot[s, j]]
        torch.testing.assert_close(w.grad[s, j], (g[s] * row).sum(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y.grad[idx[s, j], slot[s, j]], g[s] * w[s, j])
    assert torch.equal(w.grad[slot < 0], torch.zeros(int((slot < 0).sum())))
    filled = torch.zeros(5, 8, dtype=torch.bool)
    filled[idx[slot >= 0], slot[slot >= 0]] = True
    assert not y.grad[~filled].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2])
def test_per_expert_buffers_match_the_single_buffer(impl: str, dtype: torch.dtype, k: int) -> None:
    """dispatch_per_expert/combine_per_expert give dispatch/combine's values and gradients, expert by expert;
    an expert output that feeds nothing (no gradient) counts as zeros."""
    gen = torch.Generator().manual_seed(k)
    num_tokens, num_experts, capacity, width = 48, 4, 15, 10
    idx = choices(num_tokens, num_experts, k, gen)
    slot, _ = assign_slots(idx, num_experts, capacity, torch.rand(num_tokens, k, generator=gen))
    x0 = torch.randn(num_tokens, width, generator=gen).to(dtype)
    w0 = torch.rand(num_tokens, k, generator=gen)
    scale = torch.rand(num_experts, 1, 1, generator=gen).to(dtype)
    g = torch.randn(num_tokens, width, generator=gen).to(dtype)
    results = []
    for per_expert in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if per_expert:
            shape = (1, 1, capacity, width)
            blocks = dispatch_per_expert(x, idx, slot, num_experts, capacity, shape, impl=impl)
            assert len(blocks) == num_experts and all(b.shape == (1, 1, capacity, width) for b in blocks)
            outs = [b * scale[e] for e, b in enumerate(blocks)]
            outs[1] = torch.ones_like(outs[1])  # expert 1's buffer feeds nothing: its gradient is None
            kept, kept_values = outs[2], outs[2].detach().clone()  # held here: must not get its gradient
            out = combine_per_expert(outs, idx, slot, w, impl=impl)
            del outs
        else:
            buffer = dispatch(x, idx, slot, num_experts, capacity, impl=impl)
            ys = buffer * scale
            ys = torch.cat([ys[:1], torch.ones_like(ys[1:2]), ys[2:]])
            out = combine(ys, idx, slot, w, impl=impl)
        out.backward(g)
        results.append((out.detach(), x.grad, w.grad))
    assert torch.equal(kept, kept_values)
    for single, each in zip(*results):
        torch.testing.assert_close(each, single, rtol=0, atol=0)


def test_per_expert_bad_inputs_name_themselves(moe_op: None) -> None:
    idx, slot = torch.tensor([[0], [1]]), torch.tensor([[0], [0]])
    w = torch.rand(2, 1)
    with pytest.raises(ValueError, match="ys"):
        combine_per_expert([], idx, slot, w)
    with pytest.raises(ValueError, match="ys"):
        combine_per_expert([torch.randn(1, 3), torch.randn(2, 3)], idx, slot, w)
    with pytest.raises(TypeError, match="ys"):
        combine_per_expert([torch.randn(1, 3), torch.randn(1, 3, dtype=torch.float64)], idx, slot, w)
    with pytest.raises(ValueError, match="block_shape"):
        dispatch_per_expert(torch.randn(2, 3), idx, slot, 2, 1, (1, 2, 3))


def combine_step(case: str) -> tuple[list[bool], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One combine forward/backward on an intermediate y, in a given ownership situation. Returns whether
    y's gradient reused y's memory, the gradients of x (upstream of y) and w, and the tensor kept (if any)."""
    gen = torch.Generator().manual_seed(9)
    num_tokens, num_experts, capacity, width, k = 40, 4, 16, 6, 2
    idx = choices(num_tokens, num_experts, k, gen)
    slot, _ = assign_slots(idx, num_experts, capacity)
    x = torch.randn(num_experts, capacity, width, generator=gen, requires_grad=True)
    w = torch.rand(num_tokens, k, generator=gen, requires_grad=True)
    g = torch.randn(num_tokens, width, generator=gen)
    y = x * 3 if case != "saved by exp" else (x * 3).exp()
    # Reused means y's gradient is y's own tensor (a data pointer would not tell: a fresh buffer may get the
    # memory y just gave back). The weak reference adds no reference the combine could count.
    y_ref, reused = weakref.ref(y), []
    y.register_hook(lambda grad: reused.append(grad is y_ref()))
    kept = {"user keeps y": y, "detached alias": y.detach()}.get(case)
    out = combine(y if case != "view" else y.view(num_experts, capacity, width), idx, slot, w, impl="op")
    del y
    out.backward(g, retain_graph=case == "retain_graph")
    if case == "retain_graph":  # the second backward must find everything the first one used
        grads = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        out.backward(g)
        assert torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])
    return reused, x.grad, w.grad, kept


def test_combine_backward_reuses_y_only_when_nothing_else_can_see_it(moe_op: None) -> None:
    """y's gradient is written over y only when y is the combine's alone; the gradients never change."""
    reused, gx, gw, _ = combine_step("alone")
    assert reused == [True]
    for case in ("user keeps y", "detached alias", "view", "saved by exp", "retain_graph"):
        reused_here, gx_here, gw_here, kept = combine_step(case)
        assert reused_here[0] is False, case  # (retain_graph: the second backward may reuse, the first not)
        if case != "saved by exp":
            torch.testing.assert_close(gx_here, gx, rtol=0, atol=0)
            torch.testing.assert_close(gw_here, gw, rtol=0, atol=0)
        if kept is not None:  # what the user holds still has y's values
            gen = torch.Generator().manual_seed(9)
            choices(40, 4, 2, gen)
            torch.testing.assert_close(kept, torch.randn(4, 16, 6, generator=gen) * 3, rtol=0, atol=0)


def peak_allocated_bytes(fn: Any) -> int:
    """Most bytes allocated at once while ``fn`` runs, above what was allocated before (profiler's CPU
    allocation events: exact, unlike resident memory)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node: Any) -> None:
        if node.tag == torch._C._profiler._EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("k", [1, 2])
def test_routing_step_holds_one_expert_buffer_at_a_time(moe_op: None, k: int) -> None:
    """dispatch -> combine, forward and backward: besides the [S, M] output and its gradient, never more than
    one [E, C, M] buffer is alive (the combine's backward releases y before y's gradient exists)."""
    num_tokens, num_experts, width = 512, 4, 256
    capacity = num_tokens * k * 5 // (4 * num_experts)
    gen = torch.Generator().manual_seed(k)
    idx = choices(num_tokens, num_experts, k, gen)
    slot, _ = assign_slots(idx, num_experts, capacity)
    x = torch.randn(num_tokens, width, generator=gen, requires_grad=True)
    w = torch.rand(num_tokens, k, generator=gen, requires_grad=True)
    g = torch.randn(num_tokens, width, generator=gen)

    def step() -> None:
        out = combine(dispatch(x, idx, slot, num_experts, capacity, impl="op"), idx, slot, w, impl="op")
        out.backward(g)

    step()
    x.grad = w.grad = None
    row_bytes = width * 4
    peak = peak_allocated_bytes(step)
    one_buffer = (2 * num_tokens + num_experts * capacity) * row_bytes  # out, its gradient, one buffer
    assert one_buffer <= peak < one_buffer + 64 * 1024  # slack: index tensors, routes, weight gradients


def test_env_var_and_argument_select_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    idx = torch.tensor([[0], [1]])
    monkeypatch.setenv(routing.IMPL_ENV, "bogus")
    with pytest.raises(ValueError, match=routing.IMPL_ENV):
        assign_slots(idx, 2, 1)
    with pytest.raises(ValueError, match="impl"):
        assign_slots(idx, 2, 1, impl="fast")
    monkeypatch.setenv(routing.IMPL_ENV, "torch")
    assert assign_slots(idx, 2, 1)[0].tolist() == [[0], [0]]
    with pytest.raises(ValueError, match="impl='op' needs"):
        dispatch(torch.zeros(2, 3, dtype=torch.float64), idx, idx * 0, 2, 1, impl="op")


# ------------------------------------------------------------------------------------ bad inputs
def bad_calls() -> list[tuple[str, type[Exception], str, object]]:
    idx = torch.tensor([[0, 1], [1, 0]])
    slot = torch.tensor([[0, 0], [0, 1]])
    x, y, w = torch.randn(2, 3), torch.randn(2, 2, 3), torch.rand(2, 2)
    return [
        ("idx float", TypeError, "expert_idx", lambda i: assign_slots(idx.float(), 2, 1, impl=i)),
        ("idx 1-D", ValueError, "expert_idx", lambda i: assign_slots(idx[0], 2, 1, impl=i)),
        ("idx negative", ValueError, "expert_idx", lambda i: assign_slots(idx - 1, 2, 1, impl=i)),
        ("idx >= E", ValueError, "expert_idx", lambda i: assign_slots(idx + 1, 2, 1, impl=i)),
        ("E zero", ValueError, "num_experts", lambda i: assign_slots(idx, 0, 1, impl=i)),
        ("E float", TypeError, "num_experts", lambda i: assign_slots(idx, 2.0, 1, impl=i)),
        ("capacity negative", ValueError, "capacity", lambda i: assign_slots(idx, 2, -1, impl=i)),
        ("priority shape", ValueError, "priority", lambda i: assign_slots(idx, 2, 1, torch.rand(2), impl=i)),
        ("priority int", TypeError, "priority", lambda i: assign_slots(idx, 2, 1, idx, impl=i)),
        ("priority NaN", ValueError, "priority", lambda i: assign_slots(idx, 2, 1, w * float("nan"), impl=i)),
        ("active dtype", TypeError, "active", lambda i: assign_slots(idx, 2, 1, active=idx, impl=i)),
        ("order", ValueError, "order", lambda i: assign_slots(idx, 2, 1, order="expert", impl=i)),
        ("x int", TypeError, "x", lambda i: dispatch(idx, idx, slot, 2, 2, impl=i)),
        ("x rows", ValueError, "expert_idx", lambda i: dispatch(torch.randn(3, 3), idx, slot, 2, 2, impl=i)),
        ("slot >= C", ValueError, "slot", lambda i: dispatch(x, idx, slot + 2, 2, 2, impl=i)),
        ("slot < -1", ValueError, "slot", lambda i: dispatch(x, idx, slot - 2, 2, 2, impl=i)),
        ("slot shape", ValueError, "slot", lambda i: dispatch(x, idx, slot[:, :1], 2, 2, impl=i)),
        ("slot shared", ValueError, "slot", lambda i: dispatch(x, idx, torch.zeros_like(slot), 2, 2, impl=i)),
        ("y 2-D", ValueError, "y", lambda i: combine(x, idx, slot, w, impl=i)),
        ("weight shape", ValueError, "weight", lambda i: combine(y, idx, slot, w[:, :1], impl=i)),
        ("weight int", TypeError, "weight", lambda i: combine(y, idx, slot, idx, impl=i)),
        ("combine idx >= E", ValueError, "expert_idx", lambda i: combine(y, idx + 1, slot, w, impl=i)),
        ("combine shared", ValueError, "slot", lambda i: combine(y, idx, torch.zeros_like(slot), w, impl=i)),
        ("scores int", TypeError, "scores", lambda i: top_k(idx, 1, impl=i)),
        ("scores 1-D", ValueError, "scores", lambda i: top_k(w[0], 1, impl=i)),
        ("scores NaN", ValueError, "scores", lambda i: top_k(w * float("nan"), 1, impl=i)),
        ("k zero", ValueError, "k", lambda i: top_k(w, 0, impl=i)),
        ("k > E", ValueError, "k", lambda i: top_k(w, 3, impl=i)),
    ]


@pytest.mark.parametrize("case", bad_calls(), ids=lambda c: c[0])
def test_bad_inputs_raise_naming_the_argument(impl: str, case: tuple) -> None:
    _, exc, name, call = case
    with pytest.raises(exc, match=name):
        call(impl)


def test_compiled_functions_check_their_own_inputs(moe_op: None) -> None:
    """The op module checks again: a direct call with bad routes raises instead of writing out of bounds."""
    module = routing._load_op()
    idx = torch.tensor([[0, 5]])
    with pytest.raises(ValueError, match="expert_idx"):
        module.assign_slots(idx, 2, 1, None, None, True)
    with pytest.raises(ValueError, match="slot"):
        module.scatter(torch.randn(1, 3), torch.tensor([[0, 1]]), torch.tensor([[0, 9]]), 2, 2)
    with pytest.raises(ValueError, match="expert_idx"):
        module.gather([torch.randn(2, 2, 3)], idx, torch.tensor([[0, 0]]), 2, 2, torch.rand(1, 2))
    with pytest.raises(ValueError, match="blocks"):
        module.gather([torch.randn(2, 3), torch.randn(3, 3)], idx % 2, torch.tensor([[0, 0]]), 2, 2)
    with pytest.raises(TypeError, match="x"):
        module.scatter(torch.randn(1, 3, dtype=torch.float64), idx % 2, idx * 0, 2, 2)
    with pytest.raises(ValueError, match="NaN"):
        module.top_k(torch.tensor([[0.0, float("nan")]]), 1)
    with pytest.raises(ValueError, match="k must"):
        module.top_k(torch.zeros(2, 3), 4)


# ------------------------------------------------------------------------------------ packaging
def test_builder_contract_and_registration() -> None:
    import deepnvme
    import op_builder
    from op_builder.builder import csrc_root
    from op_builder.moe import MoEBuilder

    b = MoEBuilder()
    assert (b.NAME, b.BUILD_VAR, b.absolute_name()) == ("moe", "DS_BUILD_MOE", "deepnvme.ops.moe_op")
    assert isinstance(op_builder.ALL_OPS["moe"], MoEBuilder) and deepnvme.MoEBuilder is MoEBuilder
    assert b.sources() and all(b.src_path(s).is_file() for s in b.sources())
    # torch's heavy headers stay in the binding; the routing code is plain C++ or ATen only.
    with_torch = [s for s in b.sources() if "torch/extension.h" in b.src_path(s).read_text()]
    assert with_torch == ["csrc/moe/py_moe.cpp"]
    assert not any(a.startswith("-march") for a in b.cxx_args())
    assert (csrc_root() / "moe").is_dir()


def run_fresh(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120,
                          cwd=REPO_ROOT)


def test_import_stays_light_and_report_lists_the_op() -> None:
    proc = run_fresh("import sys, deepnvme.moe as m; print('torch' in sys.modules, sorted(m.__all__))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "False" and "assign_slots" in proc.stdout
    import op_builder
    from deepnvme.tools.report.collect import gather_ops

    rows = gather_ops({"moe": op_builder.ALL_OPS["moe"]}, {}, {"version": "x", "cuda": None}, None)
    assert [r.name for r in rows] == ["moe"]


def test_pure_torch_path_when_the_op_cannot_build(tmp_path: Path) -> None:
    """No compiler: op_available() says why, 'auto' quietly uses torch, 'op' raises with the reason."""
    proc = run_fresh("""
import torch
from deepnvme.moe import routing
ok, why = routing.op_available()
idx = torch.tensor([[0, 1], [1, 0], [0, 1]])
slot, counts = routing.assign_slots(idx, 2, 2)
y = routing.dispatch(torch.ones(3, 4), idx, slot, 2, 2)
try:
    routing.assign_slots(idx, 2, 2, impl="op")
    raised = "no"
except RuntimeError as exc:
    raised = str(exc)
print(ok, slot.tolist(), counts.tolist(), float(y.sum()))
print(why)
print(raised)
""", CC=str(tmp_path / "no-cc"), CXX=str(tmp_path / "no-cxx"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert proc.returncode == 0, proc.stderr
    first, why, raised = proc.stdout.splitlines()[:3]
    assert first == "False [[0, 1], [0, -1], [1, -1]] [3, 3] 16.0"
    assert "moe" in why and "unavailable" in raised


def test_setup_honours_ds_build_moe(tmp_path: Path) -> None:
    """setup.py's prebuild selects the op under DS_BUILD_MOE=1 and fails, saying why, when it cannot build it.

    ``setup.py --name`` runs the op selection without compiling anything, in a copy of the tree."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, tree / name)
    for name in ("op_builder", "deepnvme", "csrc"):
        shutil.copytree(REPO_ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}

    def setup(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "setup.py", "--name"], cwd=tree, capture_output=True,
                              text=True, env={**clean, **env}, timeout=300)

    ok = setup(DS_BUILD_MOE="1")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "prebuilding moe as deepnvme.ops.moe_op" in ok.stdout + ok.stderr
    assert "prebuilding async_io" not in ok.stdout + ok.stderr
    broken = setup(DS_BUILD_MOE="1", CC=str(tmp_path / "no-cc"), CXX=str(tmp_path / "no-cxx"))
    assert broken.returncode != 0
    assert "DS_BUILD_MOE=1 asks for op 'moe' cannot be built here" in broken.stdout + broken.stderr
