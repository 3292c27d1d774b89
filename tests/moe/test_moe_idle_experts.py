"""At inference the MoE layer runs only the experts that keep a token; its output does not change by a bit.

The reference is the same layer with an autograd graph recorded (every expert runs then); each expert's calls
are counted through forward hooks on the expert modules (hooks there leave the layer's per-expert path on).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepnvme.moe import MoE
from deepnvme.moe.routing import IMPL_ENV, op_available

M, E = 8, 8


def layer(k: int, drop_tokens: bool, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    expert = nn.Sequential(nn.Linear(M, 16), nn.GELU(), nn.Linear(16, M))
    moe = MoE(M, expert, num_experts=E, k=k, drop_tokens=drop_tokens, eval_capacity_factor=0.5,
              min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False)
    with torch.no_grad():  # a sharp gate crowds a few experts, so capacity drops routes and others stay idle
        moe.deepspeed_moe.gate.wg.weight.mul_(6.0)
    return moe.eval()


def count_calls(moe: MoE) -> list[int]:
    calls = [0] * E
    for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        expert.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.fixture(params=["op", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "op":
        ok, why = op_available()
        if not ok:
            pytest.skip(f"compiled routing op unavailable: {why}")
    monkeypatch.setenv(IMPL_ENV, request.param)
    return request.param


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("grad_off", ["no_grad", "inference_mode"])
def test_idle_experts_skipped_same_bits(impl: str, k: int, drop_tokens: bool, grad_off: str) -> None:
    moe = layer(k, drop_tokens)
    calls = count_calls(moe)
    x = torch.randn(2, 3, M)
    full, _, counts = moe(x)  # graph recorded: every expert runs
    assert calls == [1] * E
    calls[:] = [0] * E
    with getattr(torch, grad_off)():
        fast, _, counts_fast = moe(x)
    assert torch.equal(fast, full.detach())
    assert torch.equal(counts_fast, counts)
    gate = moe.deepspeed_moe.gate
    routes = gate.route(x.reshape(-1, M))
    kept = torch.bincount(routes.expert_idx[routes.slot >= 0], minlength=E)
    assert calls == [int(n > 0) for n in kept.tolist()]
    assert 0 < sum(calls) < E  # the case is one where experts really are idle
    if drop_tokens:
        assert int((routes.slot < 0).sum()) > 0  # and where capacity really drops routes


def test_no_expert_keeps_a_token(impl: str) -> None:
    """Every token masked out: no expert runs, the output is zeros as with every expert run."""
    moe = layer(2, True)
    calls = count_calls(moe)
    x = torch.randn(4, M)
    unused = torch.zeros(4, dtype=torch.bool)
    full, _, _ = moe(x, unused)
    calls[:] = [0] * E
    with torch.no_grad():
        fast, _, _ = moe(x, unused)
    assert calls == [0] * E
    assert torch.equal(fast, full.detach())
    assert not fast.any()


def test_graph_recorded_in_eval_runs_every_expert(impl: str) -> None:
    """eval() alone is not inference: with gradients wanted, idle experts run and get zero gradients (an
    optimiser treats zero and missing gradients differently)."""
    moe = layer(1, True)
    calls = count_calls(moe)
    out, _, _ = moe(torch.randn(3, M))
    out.sum().backward()
    assert calls == [1] * E
    assert all(p.grad is not None for p in moe.deepspeed_moe.experts.parameters())


def test_frozen_experts_in_eval_are_skipped(impl: str) -> None:
    """No tensor needs a gradient (a frozen model in eval): nothing is recorded, idle experts are skipped."""
    moe = layer(1, True)
    moe.requires_grad_(False)
    calls = count_calls(moe)
    moe(torch.randn(3, M))
    assert 0 < sum(calls) < E


def test_active_flags_checked() -> None:
    moe = layer(1, True)
    experts = moe.deepspeed_moe.experts
    with pytest.raises(ValueError, match="active must hold 8 flags"):
        experts(torch.zeros(1, E, 2, M), active=[True])
    with pytest.raises(ValueError, match="active must hold 8 flags"):
        experts.run_each([torch.zeros(1, 1, 2, M)] * E, [True] * 3)
