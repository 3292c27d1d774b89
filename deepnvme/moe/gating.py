"""Token-to-expert gating: DeepSpeed's top-1, top-2 and top-k maths, expressed as a route list.

A gate turns gate logits ``[S, E]`` into :class:`Routes`: for each token its k chosen experts, the slot each
route takes in its expert's capacity buffer (-1 when dropped), the combine weight of each route, the capacity
C, the auxiliary load-balancing loss and the per-expert token counts. Nothing here builds an ``S×E×C`` tensor.

The maths follows DeepSpeed 0.19 (``deepspeed/moe/sharded_moe.py``) so outputs, ``l_aux`` and ``exp_counts``
match it for the same weights, inputs and random state, with these deliberate differences (each one a
DeepSpeed weakness):

* Randomness is for training only. DeepSpeed keeps random token selection (RTS) and the Gumbel sampling of the
  second expert on at eval, so evaluating the same batch twice routes differently; here eval routing is
  deterministic (RTS off, second expert = second-highest probability).
* Ranks of an expert-parallel group agree on C before the all-to-all. DeepSpeed clamps the no-drop top-1
  capacity to the local token count after its MAX all-reduce and uses the local C when dropping, so ranks with
  different token counts disagree on C and the all-to-all hangs or fails (DeepSpeed #6809). Here C is the MAX
  over the group in both modes, and never clamped afterwards.
* No ``S >= min_capacity`` assertion for top-1 (a 1–3 token decode step works); C simply exceeds S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from deepnvme._core.checks import check_int, check_positive_number
from deepnvme.moe.routing import assign_slots, top_k

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
JITTER_EPSILON = 1e-2  # DeepSpeed's multiplicative jitter range: input * U(1-eps, 1+eps)


@dataclass
class Routes:
    """Where every token goes: the gate's answer for one batch.

    ``expert_idx`` [S, k] int64 global expert ids; ``slot`` [S, k] int64 position in the expert's buffer, -1
    when the route was dropped; ``weight`` [S, k] fp32 combine weights (0 for dropped routes, differentiable
    w.r.t. the gate); ``capacity`` C as a Python int; ``l_aux`` scalar fp32 aux loss; ``exp_counts`` [E] int64
    routed tokens per expert on this rank before dropping (detached).
    """

    expert_idx: Tensor
    slot: Tensor
    weight: Tensor
    capacity: int
    num_experts: int
    l_aux: Tensor
    exp_counts: Tensor


def capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed's C = max(ceil(S / E * factor), min_capacity), in its (default-dtype) arithmetic."""
    raw = torch.ceil((num_tokens / num_experts) * torch.tensor(factor))
    return max(int(raw), int(min_capacity))


def agree_on_capacity(local: int, group: Any, device: torch.device) -> int:
    """MAX of ``local`` over the expert-parallel group so every rank sizes its all-to-all buffers alike."""
    if group is None or dist.get_world_size(group) == 1:
        return int(local)
    t = torch.tensor([int(local)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _uniform(shape: torch.Size, low: float, high: float, device: torch.device) -> Tensor:
    """U(low, high) from the global RNG, computed as torch.distributions.Uniform does (``low + r * (high -
    low)`` on default-dtype tensors), so the same RNG state gives DeepSpeed's samples bit for bit.
    """
    lo = torch.tensor(low, device=device)
    hi = torch.tensor(high, device=device)
    return lo + torch.rand(shape, dtype=lo.dtype, device=device) * (hi - lo)


def _gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    """Gumbel(0, 1) samples as torch.distributions.Gumbel draws them (DeepSpeed's sampler): -log(-log(u))."""
    info = torch.finfo(torch.get_default_dtype())
    return -torch.log(-torch.log(_uniform(shape, info.tiny, 1 - info.eps, device)))


def _used(used_token: Tensor | None) -> Tensor | None:
    """The ``used_token`` mask as a flat bool tensor (nonzero = used), or None."""
    return None if used_token is None else used_token.reshape(-1) != 0


def _normalised(weight: Tensor) -> Tensor:
    """Scale each token's surviving route weights to sum to 1 (0 if none survive), as DeepSpeed's top-2/k."""
    denom = torch.clamp(weight.sum(dim=1, keepdim=True), min=torch.finfo(weight.dtype).eps)
    return weight / denom


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: Any = None,
) -> Routes:
    """Top-1 (Switch) gating.

    The choice is argmax of the softmax (or of logits + Gumbel noise with ``RSample``); the combine weight is
    the raw probability of the chosen expert. ``used_token`` (any dtype; nonzero = used) removes tokens from
    routing. When an expert is over capacity, the survivors are chosen as DeepSpeed does: a uniformly random
    subset with ``use_rts`` (callers pass it only in training), otherwise ``torch.topk`` over the 0/1
    assignment mask, whose choice among tied tokens is torch's (kept for bit-for-bit parity with DeepSpeed).
    """
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    if noisy_gate_policy == "RSample":
        chosen = torch.argmax(logits + _gumbel(logits.shape, logits.device), dim=1)
    else:
        chosen = torch.argmax(gates, dim=1)
    mask = F.one_hot(chosen, num_classes=e)
    used = _used(used_token)
    if used is not None:
        mask = mask * used.unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * e

    if drop_tokens:
        cap = agree_on_capacity(capacity(s, e, capacity_factor, min_capacity), ep_group, logits.device)
    else:
        cap = agree_on_capacity(int(exp_counts.max()) if s else 0, ep_group, logits.device)

    priority = None
    if use_rts:
        # Draw U[S, E] like DeepSpeed so the random stream (and thus the kept subset) is the same.
        priority = _uniform(mask.shape, 0.0, 1.0, logits.device).gather(1, chosen.unsqueeze(1))
    elif s and int(exp_counts.max()) > cap:
        top = torch.topk(mask, k=min(cap, s), dim=0)[1]
        survivors = mask * torch.zeros_like(mask).scatter_(0, top, 1)
        priority = survivors.sum(dim=1, keepdim=True).float()

    expert_idx = chosen.unsqueeze(1)
    slot, _ = assign_slots(expert_idx, e, cap if drop_tokens else None, priority, active=used)
    weight = gates.gather(1, expert_idx) * (slot >= 0)
    return Routes(expert_idx, slot, weight, cap, e, l_aux, exp_counts)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    top2_2nd_expert_sampling: bool = True,
    used_token: Tensor | None = None,
) -> Routes:
    """Top-2 (GShard) gating.

    First expert = argmax of the softmax; second = argmax over the other experts' logits, with Gumbel noise
    added first when ``top2_2nd_expert_sampling`` (callers pass it only in training). Every first choice
    outranks every second choice for a slot (then token order); C uses ``2 * capacity_factor``. Weights of the
    surviving routes are renormalised to sum to 1. The aux loss uses first choices only, as DeepSpeed's.
    ``used_token`` removes tokens from routing as in top-1 (DeepSpeed ignores it for k > 1).
    """
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    first_mask = F.one_hot(first, num_classes=e)
    second_logits = logits + _gumbel(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    second = torch.argmax(second_logits.masked_fill(first_mask.bool(), float("-inf")), dim=1)
    expert_idx = torch.stack([first, second], dim=1)
    used = _used(used_token)
    if used is None:
        exp_counts = torch.bincount(expert_idx.reshape(-1), minlength=e).detach()
    else:
        first_mask = first_mask * used.unsqueeze(1)
        exp_counts = torch.bincount(expert_idx[used].reshape(-1), minlength=e).detach()
    l_aux = torch.mean(gates.mean(dim=0) * first_mask.float().mean(dim=0)) * e * e

    if drop_tokens:
        cap = agree_on_capacity(capacity(s, e, capacity_factor * 2, min_capacity), ep_group, logits.device)
    else:
        cap = agree_on_capacity(int(exp_counts.max()) if s else 0, ep_group, logits.device)
    slot, _ = assign_slots(expert_idx, e, cap if drop_tokens else None, active=used)
    weight = _normalised(gates.gather(1, expert_idx) * (slot >= 0))
    return Routes(expert_idx, slot, weight, cap, e, l_aux, exp_counts)


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    used_token: Tensor | None = None,
) -> Routes:
    """Top-k gating for k >= 3 (DeepSpeed's ``topkgating`` with its ``'probs'`` drop policy).

    The k choices come from :func:`deepnvme.moe.routing.top_k` (exact probability ties go to the lower expert
    index, where DeepSpeed's ``torch.topk`` leaves them unspecified). Over capacity, an expert keeps the
    routes with the highest gate probability (choice rank gives no priority); C uses ``k * capacity_factor``;
    aux loss ``E * sum(me * ce) / k`` with ``ce`` over all k choices; surviving weights are renormalised to
    sum to 1. ``used_token`` as in top-2.
    """
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, expert_idx = top_k(gates, k)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, expert_idx, True)
    used = _used(used_token)
    if used is not None:
        mask &= used.unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * e * e / k

    if drop_tokens:
        cap = agree_on_capacity(capacity(s, e, capacity_factor * k, min_capacity), ep_group, logits.device)
        slot, _ = assign_slots(expert_idx, e, cap, top_gate.detach(), active=used)
    else:
        cap = agree_on_capacity(int(exp_counts.max()) if s else 0, ep_group, logits.device)
        slot, _ = assign_slots(expert_idx, e, None, active=used)
    weight = _normalised(top_gate * (slot >= 0))
    return Routes(expert_idx, slot, weight, cap, e, l_aux, exp_counts)


def check_gate_args(
    num_experts: Any,
    k: Any,
    capacity_factor: Any,
    eval_capacity_factor: Any,
    min_capacity: Any,
    noisy_gate_policy: Any,
) -> None:
    """Validate gate arguments: TypeError or ValueError naming the offending argument."""
    check_int("num_experts", num_experts, 1)
    check_int("k", k, 1)
    if k > num_experts:
        raise ValueError(f"k ({k}) must not exceed num_experts ({num_experts})")
    check_positive_number("capacity_factor", capacity_factor)
    check_positive_number("eval_capacity_factor", eval_capacity_factor)
    check_int("min_capacity", min_capacity, 0)
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")


class TopKGate(nn.Module):
    """The gate: ``wg = Linear(model_dim, num_experts, bias=False)`` plus the routing maths above.

    Same constructor as DeepSpeed's ``TopKGate`` (note its ``min_capacity`` default is 8, the ``MoE`` default
    4). Gating runs in fp32 whatever the input dtype. ``noisy_gate_policy``: ``'Jitter'`` multiplies the gate
    input by U(1-0.01, 1+0.01) in training (any k); ``'RSample'`` adds Gumbel noise to the top-1 choice in
    training (it has no effect for k > 1, as in DeepSpeed).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Any = None,
        top2_2nd_expert_sampling: bool = True,
        *,
        dropless: bool = False,
    ) -> None:
        super().__init__()
        check_int("model_dim", model_dim, 1)
        check_gate_args(
            num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy
        )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = float(capacity_factor)
        self.eval_capacity_factor = float(eval_capacity_factor)
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = bool(drop_tokens)
        self.dropless = bool(dropless)
        self.use_rts = bool(use_rts)
        self.top2_2nd_expert_sampling = bool(top2_2nd_expert_sampling)

    def _set_ep_group(self, ep_group: Any) -> None:
        """Attach the expert-parallel group (setting the same group again is harmless, unlike DeepSpeed)."""
        if self.ep_group is not None and ep_group is not self.ep_group:
            raise ValueError("ep_group: this gate already has a different expert-parallel group")
        self.ep_group = ep_group

    def route(self, input: Tensor, used_token: Tensor | None = None) -> Routes:
        """Route ``input`` [S, model_dim] and return the :class:`Routes`."""
        if input.dim() != 2 or input.shape[1] != self.wg.in_features:
            raise ValueError(f"input must be [tokens, {self.wg.in_features}], got {tuple(input.shape)}")
        if used_token is not None and used_token.numel() != input.shape[0]:
            raise ValueError(
                f"used_token must have one entry per token ({input.shape[0]}), got {used_token.numel()}"
            )
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * _uniform(x.shape, 1.0 - JITTER_EPSILON, 1.0 + JITTER_EPSILON, x.device)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        routes = self._gate(logits, factor, used_token)
        if input.shape[0] == 0:  # no tokens: l_aux 0 (not an empty mean's NaN), still in the graph
            routes.l_aux = logits.sum() * 0.0
        return routes

    def _gate(self, logits: Tensor, factor: float, used_token: Tensor | None) -> Routes:
        """Run the gating function for this gate's k (dropless: no capacity, nothing agreed)."""
        drop = self.drop_tokens and not self.dropless
        group = None if self.dropless else self.ep_group
        if self.k == 1:
            noise = self.noisy_gate_policy if self.training else None
            return top1gating(
                logits,
                factor,
                self.min_capacity,
                used_token,
                noise,
                drop,
                self.use_rts and self.training,
                group,
            )
        if self.k == 2:
            return top2gating(
                logits,
                factor,
                self.min_capacity,
                drop,
                group,
                self.top2_2nd_expert_sampling and self.training,
                used_token,
            )
        return topkgating(
            logits, self.k, factor, self.min_capacity, drop, group, used_token
        )

    def forward(
        self,
        input: Tensor,
        used_token: Tensor | None = None,
        sparse_routes: bool = False,
        use_tutel: bool = False,
    ) -> tuple[Any, ...]:
        """DeepSpeed's return forms, for code that calls the gate directly.

        ``sparse_routes=True``: ``(l_aux, C, E, indices[k,S] int32 (-1 = dropped), locations[k,S] int32,
        gates[k,S] fp32, exp_counts)``. Otherwise the legacy dense ``(l_aux, combine_weights[S,E,C] fp32,
        dispatch_mask[S,E,C] bool, exp_counts)`` — quadratic in S, built only on request. ``use_tutel`` is
        ignored.
        """
        r = self.route(input, used_token)
        kept = r.slot >= 0
        if sparse_routes:
            indices = torch.where(kept, r.expert_idx, torch.full_like(r.expert_idx, -1))
            return (
                r.l_aux,
                r.capacity,
                r.num_experts,
                indices.t().to(torch.int32).contiguous(),
                r.slot.clamp(min=0).t().to(torch.int32).contiguous(),
                r.weight.t().contiguous(),
                r.exp_counts,
            )
        s, k = r.slot.shape
        combine_weights = r.weight.new_zeros(s, r.num_experts, r.capacity)
        tok = torch.arange(s, device=r.slot.device).unsqueeze(1).expand_as(r.slot)
        combine_weights = combine_weights.index_put(
            (tok[kept], r.expert_idx[kept], r.slot[kept]), r.weight[kept], accumulate=True
        )
        return r.l_aux, combine_weights, combine_weights.bool(), r.exp_counts
