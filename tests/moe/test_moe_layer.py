"""deepnvme.moe in one process: DeepSpeed's gating maths (checked against a dense-mask reference written
here), the forward contract, argument checking, eval determinism, distinct experts and the parameter
helpers."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from deepnvme.moe import (
    MoE,
    TopKGate,
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)

M = 8


def mlp(width: int = M, hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))


def make(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    kw.setdefault("num_experts", 4)
    kw.setdefault("use_rts", False)
    kw.setdefault("top2_2nd_expert_sampling", False)
    moe = MoE(M, mlp(), **kw)
    with torch.no_grad():  # a sharper gate makes loads uneven, so capacity limits actually drop tokens
        moe.deepspeed_moe.gate.wg.weight.mul_(4.0)
    return moe


def dense_reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpeed's legacy dense-mask maths ([S,E,C] one-hots and einsums), independent of the index path."""
    gate = moe.deepspeed_moe.gate
    tokens = x.reshape(-1, M)
    s, e = tokens.shape[0], moe.num_experts
    logits = tokens.float() @ gate.wg.weight.float().t()
    gates = F.softmax(logits, dim=1)
    cf = gate.capacity_factor if moe.training else gate.eval_capacity_factor
    me = gates.mean(0)
    if gate.k == 1:
        mask1 = F.one_hot(gates.argmax(1), e)
        counts = mask1.sum(0)
        l_aux = (me * mask1.float().mean(0)).sum() * e
        if gate.drop_tokens:
            cap = max(math.ceil(s / e * cf), gate.min_capacity)
        else:
            cap = int(counts.max())
        top = torch.topk(mask1, k=min(cap, s), dim=0)[1]
        mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top, 1)
        loc = torch.cumsum(mask1, 0) - 1
        comb = (
            (gates * mask1).unsqueeze(-1)
            * F.one_hot((loc * mask1).sum(1), cap).unsqueeze(1)
            * mask1.unsqueeze(-1)
        )
    elif gate.k == 2:
        i1 = gates.argmax(1)
        m1 = F.one_hot(i1, e)
        m2 = F.one_hot(logits.masked_fill(m1.bool(), float("-inf")).argmax(1), e)
        l1 = torch.cumsum(m1, 0) - 1
        l2 = torch.cumsum(m2, 0) - 1 + m1.sum(0, keepdim=True)
        counts = (m1 + m2).sum(0)
        l_aux = (me * m1.float().mean(0)).mean() * e * e
        cap = max(math.ceil(s / e * cf * 2), gate.min_capacity) if gate.drop_tokens else int(counts.max())
        m1 = m1 * (l1 < cap)
        m2 = m2 * (l2 < cap)
        g1 = (gates * m1).sum(1)
        g2 = (gates * m2).sum(1)
        d = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        g1, g2 = g1 / d, g2 / d
        c1 = F.one_hot((l1 * m1).sum(1), cap) * m1.sum(1, keepdim=True)
        c2 = F.one_hot((l2 * m2).sum(1), cap) * m2.sum(1, keepdim=True)
        comb = (g1[:, None, None] * m1[:, :, None] * c1[:, None, :]) + (
            g2[:, None, None] * m2[:, :, None] * c2[:, None, :]
        )
    else:
        k = gate.k
        tg, ti = torch.topk(gates, k, dim=1)
        mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, ti, True)
        counts = mask.sum(0)
        l_aux = (me * mask.float().mean(0)).mean() * e * e / k
        if gate.drop_tokens:
            cap = max(math.ceil(s / e * cf * k), gate.min_capacity)
            masked = torch.zeros_like(gates).scatter(1, ti, tg)
            ci = torch.topk(masked, k=min(cap, s), dim=0)[1]
            mask &= torch.zeros_like(mask).scatter_(0, ci, True)
        else:
            cap = int(counts.max())
        loc = torch.cumsum(mask, 0) - 1
        gm = gates * mask
        gm = gm / torch.clamp(gm.sum(1, keepdim=True), min=torch.finfo(gm.dtype).eps)
        comb = gm.unsqueeze(-1) * F.one_hot(loc * mask, cap) * mask.unsqueeze(-1)
    comb = comb.float()
    dispatched = torch.einsum("sec,sm->ecm", (comb != 0).to(tokens.dtype), tokens)
    outs = torch.stack(
        [ex(dispatched[i]) for i, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts)]
    )
    y = torch.einsum("sec,ecm->sm", comb, outs.float()).to(x.dtype)
    return y.reshape(x.shape), l_aux, counts


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_matches_dense_reference_and_gradients(k: int, drop: bool) -> None:
    moe = make(k=k, drop_tokens=drop, capacity_factor=0.75, min_capacity=2)
    x = torch.randn(2, 24, M, requires_grad=True)
    out, l_aux, counts = moe(x)
    ref, ref_aux, ref_counts = dense_reference(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, ref_aux)
    assert counts.tolist() == ref_counts.tolist()
    assert int(counts.sum()) == 48 * k
    routes = moe.deepspeed_moe.gate.route(x.reshape(-1, M))
    assert bool((routes.slot < 0).any()) == drop, (
        "the drop-on cases must really drop, the drop-off ones never"
    )
    # gradients of both paths agree for the input, the gate and every expert
    w = torch.randn_like(out)
    g_ours = torch.autograd.grad((out * w).sum() + l_aux, [x, *moe.parameters()])
    g_ref = torch.autograd.grad((ref * w).sum() + ref_aux, [x, *moe.parameters()])
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert g_ours[1].abs().sum() > 0  # the gate learns through the combine weights


@pytest.mark.parametrize("k", [1, 2])
def test_per_expert_path_equals_the_single_buffer_path_and_hooks_still_fire(
        k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At ep_size 1 (experts not grouped) the layer runs each expert on its own buffer; a forward hook on the
    experts container (which that path would skip) sends it back through Experts.forward. Both give the same
    numbers."""
    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", "loop")
    results, calls = [], []
    for hooked in (False, True):
        moe = make(k=k, capacity_factor=0.75, min_capacity=2)
        if hooked:
            moe.deepspeed_moe.experts.register_forward_hook(lambda mod, inp, out: calls.append(out.shape))
        x = torch.randn(2, 24, M, generator=torch.Generator().manual_seed(k), requires_grad=True)
        out, l_aux, _ = moe(x)
        grads = torch.autograd.grad((out * out.detach()).sum() + l_aux, [x, *moe.parameters()])
        results.append((out.detach(), *grads))
    assert len(calls) == 1  # the hooked layer took the single-buffer path, whose call the hook saw
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 40),
    experts=st.sampled_from([1, 2, 4, 8]),
    k=st.integers(1, 3),
    factor=st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]),
    min_capacity=st.integers(0, 5),
    drop=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gating_matches_dense_reference_everywhere(
    tokens: int, experts: int, k: int, factor: float, min_capacity: int, drop: bool, seed: int
) -> None:
    k = min(k, experts)
    moe = make(
        seed, num_experts=experts, k=k, capacity_factor=factor, min_capacity=min_capacity, drop_tokens=drop
    )
    x = torch.randn(tokens, M, generator=torch.Generator().manual_seed(seed))
    out, l_aux, counts = moe(x)
    ref, ref_aux, ref_counts = dense_reference(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, ref_aux)
    assert counts.tolist() == ref_counts.tolist()


def test_import_is_lazy() -> None:
    code = "import sys, deepnvme, deepnvme.moe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_capacity_bounds_every_expert_and_dropped_tokens_are_zero() -> None:
    moe = make(k=1, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(40, M)
    out, _, counts = moe(x)
    routes = moe.deepspeed_moe.gate.route(x)
    cap = routes.capacity
    assert cap == math.ceil(40 / 4 * 0.5)
    kept = torch.bincount(routes.expert_idx[routes.slot >= 0], minlength=4)
    assert torch.equal(kept, counts.clamp(max=cap))
    dropped = (routes.slot < 0).squeeze(1)
    assert dropped.any()
    assert torch.count_nonzero(out[dropped]) == 0


def test_few_tokens_below_min_capacity() -> None:
    out, _, counts = make(k=1)(torch.randn(2, M))  # DeepSpeed asserts S >= min_capacity here
    assert out.shape == (2, M) and int(counts.sum()) == 2


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_no_tokens(k: int, drop: bool) -> None:
    moe = make(k=k, drop_tokens=drop)
    x = torch.randn(0, M, requires_grad=True)
    out, l_aux, counts = moe(x)
    assert out.shape == (0, M) and l_aux.detach().item() == 0.0 and counts.tolist() == [0, 0, 0, 0]
    (out.sum() + l_aux).backward()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_used_token_masks_tokens_out(k: int) -> None:
    moe = make(k=k)  # DeepSpeed honours used_token for k=1 only
    x = torch.randn(16, M)
    used = torch.ones(16)
    used[::2] = 0
    out, _, counts = moe(x, used)
    assert int(counts.sum()) == 8 * k
    assert torch.count_nonzero(out[::2]) == 0 and torch.count_nonzero(out[1::2]) > 0
    routes = moe.deepspeed_moe.gate.route(x, used)
    assert bool((routes.slot[::2] == -1).all()) and bool((routes.slot[1::2] >= 0).all())


def test_eval_routing_is_deterministic_and_training_is_random() -> None:
    torch.manual_seed(1)
    moe = MoE(
        M, mlp(), num_experts=4, k=2, min_capacity=1, capacity_factor=0.5
    )  # RTS and sampling on (defaults)
    x = torch.randn(64, M)
    moe.eval()
    torch.manual_seed(10)
    a = moe(x)[0]
    torch.manual_seed(20)
    b = moe(x)[0]
    assert torch.equal(a, b)
    moe.train()
    torch.manual_seed(10)
    c = moe(x)[0]
    torch.manual_seed(20)
    d = moe(x)[0]
    assert not torch.equal(c, d)


@pytest.mark.parametrize("policy", ["Jitter", "RSample"])
def test_noisy_gate_policies_act_in_training_only(policy: str) -> None:
    moe = make(k=1, noisy_gate_policy=policy, drop_tokens=False)
    x = torch.randn(64, M)
    clean = make(k=1, drop_tokens=False)
    clean.load_state_dict(moe.state_dict())
    moe.eval()
    clean.eval()
    torch.manual_seed(3)
    a = moe(x)[0]
    torch.manual_seed(4)
    assert torch.equal(a, moe(x)[0]) and torch.equal(a, clean(x)[0])
    moe.train()
    torch.manual_seed(3)
    b = moe(x)[0]
    torch.manual_seed(4)
    assert not torch.equal(b, moe(x)[0])


def test_ignored_options_warn() -> None:
    with pytest.warns(UserWarning, match="use_tutel"):
        make(use_tutel=True)
    with pytest.warns(UserWarning, match="RSample"):
        make(k=2, noisy_gate_policy="RSample")


def test_top1_rts_eval_is_deterministic() -> None:
    torch.manual_seed(2)
    moe = MoE(M, mlp(), num_experts=2, k=1, min_capacity=1, capacity_factor=0.5).eval()
    x = torch.randn(64, M)
    torch.manual_seed(3)
    a = moe(x)[0]
    torch.manual_seed(4)
    assert torch.equal(a, moe(x)[0])


def test_experts_start_distinct_unless_asked() -> None:
    def expert_weights(moe: MoE) -> list[torch.Tensor]:
        return [e[0].weight for e in moe.deepspeed_moe.experts.deepspeed_experts]

    w = expert_weights(make())
    assert all(not torch.equal(w[0], other) for other in w[1:])
    same = expert_weights(make(distinct_experts=False))
    assert all(torch.equal(same[0], other) for other in same[1:])
    # same seed, same experts
    assert all(torch.equal(a, b) for a, b in zip(w, expert_weights(make())))


@pytest.mark.parametrize("kw", [{}, {"use_residual": True, "k": 2}])
def test_distinct_experts_leave_the_global_rng_where_deepspeeds_layer_does(kw: dict) -> None:
    """Only the gate (and coefficient) draw from the global RNG, as in DeepSpeed: a module built after the
    layer initialises the same with distinct experts as with DeepSpeed's identical copies."""

    def build(distinct: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(5)
        MoE(M, mlp(), num_experts=4, distinct_experts=distinct, **kw)
        return torch.get_rng_state(), nn.Linear(M, M).weight

    (state, after), (deepspeed_state, deepspeed_after) = build(True), build(False)
    assert torch.equal(state, deepspeed_state)
    assert torch.equal(after, deepspeed_after)


def test_num_experts_list() -> None:
    assert make(num_experts=[4]).num_experts == 4
    with pytest.raises(ValueError, match="num_experts"):
        make(num_experts=[4, 8])


@pytest.mark.parametrize(
    "kw, error, name",
    [
        ({"num_experts": 0}, ValueError, "num_experts"),
        ({"num_experts": 2.5}, TypeError, "num_experts"),
        ({"ep_size": 3}, ValueError, "ep_size"),
        ({"ep_size": 0}, ValueError, "ep_size"),
        ({"ep_size": True}, TypeError, "ep_size"),
        ({"k": 0}, ValueError, "k"),
        ({"k": 5}, ValueError, "k"),
        ({"k": "2"}, TypeError, "k"),
        ({"capacity_factor": 0.0}, ValueError, "capacity_factor"),
        ({"capacity_factor": "1.0"}, TypeError, "capacity_factor"),
        ({"eval_capacity_factor": float("nan")}, ValueError, "eval_capacity_factor"),
        ({"min_capacity": -1}, ValueError, "min_capacity"),
        ({"noisy_gate_policy": "Gaussian"}, ValueError, "noisy_gate_policy"),
    ],
)
def test_bad_arguments_name_themselves(kw: dict, error: type[Exception], name: str) -> None:
    """The package's rule: TypeError for a wrong type, ValueError for a wrong value, naming the argument."""
    with pytest.raises(error, match=name):
        make(**kw)


def test_bad_construction_and_input() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        MoE(0, mlp())
    with pytest.raises(TypeError, match="expert"):
        MoE(M, lambda t: t)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hidden_states"):
        make()(torch.randn(3, M + 1))
    with pytest.raises(ValueError, match="used_token"):
        make()(torch.randn(3, M), torch.ones(4))


def test_residual_layer_keys_and_mix() -> None:
    expert = mlp()
    torch.manual_seed(0)
    moe = MoE(M, expert, num_experts=2, use_residual=True)
    assert moe.mlp is expert
    keys = set(moe.state_dict())
    assert {"coefficient.weight", "coefficient.bias", "deepspeed_moe.gate.wg.weight"} <= keys
    assert "deepspeed_moe.experts.deepspeed_experts.1.2.bias" in keys and "mlp.0.weight" in keys
    x = torch.randn(5, M)
    out = moe(x)[0]
    coef = F.softmax(moe.coefficient(x), dim=-1)
    moe_only = moe.deepspeed_moe(x)
    torch.testing.assert_close(out, moe_only * coef[:, :1] + expert(x) * coef[:, 1:])


def test_gate_return_forms_agree() -> None:
    torch.manual_seed(0)
    gate = TopKGate(M, 4, k=2, min_capacity=1, top2_2nd_expert_sampling=False)
    x = torch.randn(12, M)
    l_aux, cap, e, idx, loc, w, counts = gate(x, sparse_routes=True)
    l_aux2, combine_w, dispatch_mask, counts2 = gate(x)
    assert combine_w.shape == (12, 4, cap) and e == 4 and torch.equal(counts, counts2)
    for s in range(12):
        for j in range(2):
            if idx[j, s] >= 0:
                assert combine_w[s, idx[j, s], loc[j, s]] == w[j, s]
    assert torch.equal(dispatch_mask, combine_w != 0)


def test_param_helpers() -> None:
    model = nn.Sequential(nn.Linear(M, M), make(num_experts=2))
    assert has_moe_layers(model) == (True, 2)
    assert has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    params = list(model.parameters())
    shared, expert = split_params_into_shared_and_expert_params(params)
    assert (
        len(expert) == 8 and all(is_moe_param(p) for p in expert) and not any(is_moe_param(p) for p in shared)
    )
    assert all(p.group_name == "ep_size_1" for p in expert)

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": params, "lr": 0.1}
    )  # no 'name': fine
    moe_groups = [g for g in groups if is_moe_param_group(g)]
    assert len(moe_groups) == 1 and moe_groups[0]["name"] == "ep_size_1" and moe_groups[0]["lr"] == 0.1
    assert len(groups[0]["params"]) == len(shared)
    chunked = split_params_into_different_moe_groups_for_optimizer(
        [{"params": params, "name": "g"}], max_group_size=16 * M + 16
    )
    sizes = [sum(p.numel() for p in g["params"]) for g in chunked if is_moe_param_group(g)]
    assert sum(sizes) == sum(p.numel() for p in expert) and max(sizes) <= 16 * M + 16 and min(sizes) > 0
    auto = configure_moe_param_groups(params)
    assert auto[0]["name"] == "dense-params" and any(is_moe_param_group(g) for g in auto)
    assert configure_moe_param_groups(auto) is auto
    opt = torch.optim.SGD(auto, lr=0.1)
    assert len(opt.param_groups) == 2
    with pytest.raises(ValueError, match="param_groups"):
        split_params_into_different_moe_groups_for_optimizer("params")  # type: ignore[arg-type]
