"""Token routing for Mixture of Experts: capacity slots, dispatch into expert buffers, weighted combine.

A *route* is one (token s, choice j) pair of the gate's ``expert_idx[S, k]``. :func:`assign_slots` gives
each route its row in its expert's capacity buffer (or -1 when the route is dropped), :func:`dispatch` copies
tokens into the ``[E, C, M]`` buffers the experts run on, and :func:`combine` brings the expert outputs back,
weighted per route. Everything works by index (gather/scatter): nothing of size S x E x C is ever built,
unlike the one-hot einsum DeepSpeed used before its index dispatch. :func:`dispatch_per_expert` and
:func:`combine_per_expert` do the same with one buffer per expert, so experts run on buffers of their own
and nothing is split or concatenated around them.

Memory: the compiled dispatch saves only the routes for its backward, the combine the expert outputs (the
weights' gradient needs them). The combine's backward takes those dots first and then lets the outputs go, or
writes their gradient over them when nothing else can reach them, so one ``[E, C, M]`` buffer at a time is
alive where the combine's gradient is formed.

Slot order is DeepSpeed's, so the same gate decisions put the same token in the same row:

* ``order="choice"`` (top-1 and top-2 gating): all first choices in token order, then the second choices, so
  in each expert every first choice outranks every second choice (``top2gating``'s ``loc2 + count1``).
* ``order="token"`` (``topkgating``, k >= 3): token order over the token's whole choice set; choice rank gives
  no priority.

With a ``capacity``, an expert keeps at most ``capacity`` routes. Without ``priority`` it keeps the first ones
in slot order (top-2 and the ``'position'`` policy). With ``priority`` it keeps its ``capacity`` routes of
highest priority (random token selection in top-1, the ``'probs'`` policy of top-k); ties go to the route that
comes first in slot order. Either way the kept routes take slots 0, 1, ... in slot order, which is exactly
``cumsum(mask) - 1`` after DeepSpeed's drop.

Each public function runs the compiled ``moe`` op (``op_builder.moe.MoEBuilder``, through
``deepnvme._core.op``; its autograd Functions are in :mod:`.routing_autograd`) for CPU tensors when it loads,
else the pure-torch code below, which is the reference the op is tested against. ``impl="torch"`` or the
environment variable ``DEEPNVME_MOE_IMPL=torch`` forces the pure-torch path; ``impl="op"`` (or the variable
set to ``op``) demands the op and raises if it cannot load.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import torch

from deepnvme._core.checks import check_int
from deepnvme._core.op import moe_module
from deepnvme.moe.routing_autograd import CombineBlocksOp, CombineOp, DispatchBlocksOp, DispatchOp

__all__ = ["IMPL_ENV", "assign_slots", "combine", "combine_per_expert", "dispatch", "dispatch_per_expert",
           "op_available", "top_k"]

IMPL_ENV = "DEEPNVME_MOE_IMPL"
_IMPLS = ("auto", "op", "torch")
_ORDERS = ("choice", "token")
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_op_lock = threading.Lock()
_op_state: dict[str, Any] = {}


# --------------------------------------------------------------------------------------------- op loading
def _load_op() -> Any:
    """The compiled routing module, or None when it cannot be built here (reason kept for op_available)."""
    with _op_lock:
        if "module" not in _op_state:
            try:
                _op_state["module"] = moe_module()
                _op_state["error"] = None
            except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
                _op_state["module"] = None
                _op_state["error"] = f"{type(exc).__name__}: {exc}"
        return _op_state["module"]


def op_available() -> tuple[bool, str | None]:
    """Whether the compiled op loads, and why not when it does not (may trigger the JIT build)."""
    module = _load_op()
    return module is not None, _op_state.get("error")


def _resolve_impl(impl: str | None, *tensors: torch.Tensor) -> Any:
    """The op module to use, or None for the pure-torch path."""
    choice = impl if impl is not None else os.environ.get(IMPL_ENV, "auto") or "auto"
    if choice not in _IMPLS:
        source = "impl" if impl is not None else IMPL_ENV
        raise ValueError(f"{source} must be one of {_IMPLS}, got {choice!r}")
    if choice == "torch":
        return None
    fits = all(t.device.type == "cpu" for t in tensors) and all(
        t.dtype in _OP_DTYPES for t in tensors if t.is_floating_point())
    if choice == "op":
        if not fits:
            raise ValueError("impl='op' needs CPU tensors of float32, bfloat16 or float16")
        module = _load_op()
        if module is None:
            raise RuntimeError(f"deepnvme.moe: the compiled routing op is unavailable: {_op_state['error']}")
        return module
    return _load_op() if fits else None


def uses_op(*tensors: torch.Tensor) -> bool:
    """Whether dispatch/combine on these tensors run the compiled op (per ``impl``'s environment default)."""
    return _resolve_impl(None, *tensors) is not None


# --------------------------------------------------------------------------------------------- validation
def _check_index(name: str, t: Any, ndim: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 or int32 tensor, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D [S, k], got shape {tuple(t.shape)}")


def _check_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Raise ValueError unless every element lies in [low, high)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise ValueError(f"{name} holds {bad}, outside [{low}, {high})")


def _check_float(name: str, t: Any, shape: tuple[int, ...] | None = None, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float32/64, bfloat16, float16), got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


# --------------------------------------------------------------------------------------------- top_k
def top_k(scores: torch.Tensor, k: int, *, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row, largest first: ``(values[S, k], indices[S, k] int64)``.

    Ties go to the lower expert index (what ``torch.argmax`` and a stable descending sort choose, so k=1 is
    the top-1/top-2 gates' argmax); ``torch.topk`` leaves the order of ties unspecified. ``values`` are
    gathered from ``scores``, so they carry its gradient on either path.
    """
    _check_float("scores", scores, ndim=2)
    check_int("k", k, 1)
    if k > scores.shape[1]:
        raise ValueError(f"k must be <= the number of experts ({scores.shape[1]}), got {k}")
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores must not hold NaN")
    module = _resolve_impl(impl, scores)
    if module is not None and scores.dtype == torch.float32:
        _, indices = module.top_k(scores.detach(), k)
    elif impl == "op" or (impl is None and os.environ.get(IMPL_ENV) == "op"):
        raise ValueError("the compiled top_k takes float32 scores")
    else:
        indices = torch.sort(scores.detach(), dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, indices), indices


# --------------------------------------------------------------------------------------------- assign_slots
def assign_slots(expert_idx: torch.Tensor, num_experts: int, capacity: int | None,
                 priority: torch.Tensor | None = None, *, order: str | None = None,
                 active: torch.Tensor | None = None,
                 impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Give every route its row in its expert's capacity buffer, DeepSpeed's way.

    Args:
        expert_idx: ``[S, k]`` int64/int32, the expert of token s's j-th choice, in ``[0, num_experts)``.
        num_experts: E.
        capacity: rows per expert (C); None keeps every route (no dropping).
        priority: optional ``[S, k]`` floating scores; with a capacity, each expert keeps its ``capacity``
            highest-priority routes (ties: earlier slot order first). Without it, the first ``capacity`` in
            slot order are kept.
        order: ``"choice"`` (choice-major, DeepSpeed's top-1/top-2) or ``"token"`` (token-major, DeepSpeed's
            top-k for k >= 3); default: ``"choice"`` for k <= 2, else ``"token"``.
        active: optional bool ``[S]`` or ``[S, k]``; inactive routes are not routed at all (slot -1, not
            counted), as DeepSpeed's ``used_token`` mask does in top-1.
        impl: ``"auto"`` (default), ``"op"`` or ``"torch"``; see the module doc.

    Returns:
        ``slot`` ``[S, k]`` int64 (-1 for a dropped route) and ``exp_counts`` ``[E]`` int64, the routes per
        expert before dropping.
    """
    _check_index("expert_idx", expert_idx)
    check_int("num_experts", num_experts, 1)
    if capacity is not None:
        check_int("capacity", capacity, 0)
    num_tokens, k = expert_idx.shape
    if k < 1:
        raise ValueError(f"expert_idx must have k >= 1 columns, got shape {tuple(expert_idx.shape)}")
    _check_range("expert_idx", expert_idx, 0, num_experts)
    if order is None:
        order = "choice" if k <= 2 else "token"
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    if priority is not None:
        _check_float("priority", priority, shape=tuple(expert_idx.shape))
        _check_same_device(expert_idx=expert_idx, priority=priority)
        if bool(torch.isnan(priority).any()):
            raise ValueError("priority must not hold NaN")
    if active is not None:
        if not isinstance(active, torch.Tensor):
            raise TypeError(f"active must be a torch.Tensor, got {type(active).__name__}")
        if active.dtype != torch.bool:
            raise TypeError(f"active must be a bool tensor, got {active.dtype}")
        if tuple(active.shape) == (num_tokens,):
            active = active.unsqueeze(1).expand(num_tokens, k)
        elif tuple(active.shape) != (num_tokens, k):
            raise ValueError(f"active must have shape ({num_tokens},) or ({num_tokens}, {k}), "
                             f"got {tuple(active.shape)}")
        _check_same_device(expert_idx=expert_idx, active=active)
    module = _resolve_impl(impl, expert_idx, *(t for t in (priority, active) if t is not None))
    if module is not None:
        slot, counts = module.assign_slots(
            expert_idx.contiguous(), num_experts, -1 if capacity is None else capacity,
            None if priority is None else priority.detach().float().contiguous(),
            None if active is None else active.contiguous(), order == "choice")
        return slot, counts
    return _assign_slots_torch(expert_idx, num_experts, capacity, priority, order, active)


def _assign_slots_torch(expert_idx: torch.Tensor, num_experts: int, capacity: int | None,
                        priority: torch.Tensor | None, order: str,
                        active: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: rank the routes of each expert in slot order with stable sorts (O(Sk log Sk))."""
    num_tokens, k = expert_idx.shape
    device = expert_idx.device

    def in_order(t: torch.Tensor) -> torch.Tensor:  # [S, k] -> flat, in slot order
        return (t.t() if order == "choice" else t).reshape(-1)

    # Inactive routes go to an extra bucket E, so they neither count nor take slots.
    key = in_order(expert_idx).long()
    if active is not None:
        key = torch.where(in_order(active), key, torch.full_like(key, num_experts))
    n = key.numel()
    counts_all = torch.bincount(key, minlength=num_experts + 1)
    exp_counts = counts_all[:num_experts].clone()
    starts = torch.cumsum(counts_all, 0) - counts_all  # first sorted position of each bucket
    by_expert = torch.argsort(key, stable=True)  # grouped by expert, slot order kept inside a group
    sorted_key = key[by_expert]
    positions = torch.arange(n, device=device)
    rank = positions - starts[sorted_key]  # rank in slot order within the expert

    if capacity is None:
        kept_sorted = torch.ones(n, dtype=torch.bool, device=device)
    elif priority is None:
        kept_sorted = rank < capacity
    else:
        # Highest priority first, ties in slot order (stable), then grouped by expert (stable again).
        by_priority = torch.argsort(in_order(priority.detach()), descending=True, stable=True)
        grouped = by_priority[torch.argsort(key[by_priority], stable=True)]
        prio_rank = positions - starts[key[grouped]]
        kept = torch.empty(n, dtype=torch.bool, device=device)
        kept[grouped] = prio_rank < capacity
        kept_sorted = kept[by_expert]
        # The survivors take slots 0, 1, ... in slot order: an exclusive running count inside each group.
        running = torch.cumsum(kept_sorted.long(), 0) - kept_sorted.long()
        rank = running - running[starts[sorted_key]]
    kept_sorted &= sorted_key < num_experts
    slot_flat = torch.empty(n, dtype=torch.long, device=device)
    slot_flat[by_expert] = torch.where(kept_sorted, rank, torch.full_like(rank, -1))
    slot = slot_flat.view(k, num_tokens).t() if order == "choice" else slot_flat.view(num_tokens, k)
    return slot.contiguous(), exp_counts


# --------------------------------------------------------------------------------------------- dispatch
def _check_routes(expert_idx: torch.Tensor, slot: torch.Tensor, num_experts: int, capacity: int,
                  num_tokens: int) -> None:
    _check_index("expert_idx", expert_idx)
    _check_index("slot", slot)
    if expert_idx.shape[0] != num_tokens:
        raise ValueError(f"expert_idx must have {num_tokens} rows (one per token), got {expert_idx.shape[0]}")
    if slot.shape != expert_idx.shape:
        raise ValueError(f"slot must have expert_idx's shape {tuple(expert_idx.shape)}, "
                         f"got {tuple(slot.shape)}")
    _check_range("expert_idx", expert_idx, 0, num_experts)
    _check_range("slot", slot, -1, capacity)


def _flat_routes(expert_idx: torch.Tensor, slot: torch.Tensor,
                 capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept routes as (token, flat row e*C + slot), choice-major so k > 1 sums run in choice order.

    Raises ValueError when two routes claim one row, as the compiled op does (its scatters would race).
    """
    kept = (slot >= 0).t()
    choice, token = kept.nonzero(as_tuple=True)
    rows = expert_idx.t()[choice, token].long() * capacity + slot.t()[choice, token].long()
    if rows.numel() and torch.unique(rows).numel() != rows.numel():
        raise ValueError("slot: two routes share one expert row (slots must come from assign_slots)")
    return token, rows


def dispatch(x: torch.Tensor, expert_idx: torch.Tensor, slot: torch.Tensor, num_experts: int, capacity: int,
             *, impl: str | None = None) -> torch.Tensor:
    """Copy each kept route's token into its expert buffer: ``[S, M]`` -> ``[E, C, M]``, zeros where empty.

    ``slot`` must come from :func:`assign_slots` (two routes never share a row). Differentiable in ``x``.
    """
    _check_float("x", x, ndim=2)
    check_int("num_experts", num_experts, 1)
    check_int("capacity", capacity, 0)
    _check_routes(expert_idx, slot, num_experts, capacity, x.shape[0])
    _check_same_device(x=x, expert_idx=expert_idx, slot=slot)
    module = _resolve_impl(impl, x, expert_idx)
    if module is not None:
        return DispatchOp.apply(module, x, expert_idx.contiguous(), slot.contiguous(), num_experts, capacity)
    token, rows = _flat_routes(expert_idx, slot, capacity)
    # In place into a fresh buffer: an out-of-place index_copy would hold a second [E*C, M] copy.
    out = x.new_zeros(num_experts * capacity, x.shape[1]).index_copy_(0, rows, x.index_select(0, token))
    return out.view(num_experts, capacity, x.shape[1])


def combine(y: torch.Tensor, expert_idx: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
            *, impl: str | None = None) -> torch.Tensor:
    """Weighted sum of each token's expert rows: ``[E, C, M]`` -> ``[S, M]``.

    ``out[s] = sum over kept j of weight[s, j] * y[expert_idx[s, j], slot[s, j]]``.

    ``y`` may also be ``[..., C, M]`` with leading dims that multiply to E (the ``[ep, E_local, C, M]`` the
    experts return): taking it unreshaped lets the compiled backward reuse its memory (see ``CombineOp``).
    Accumulates in float32 (float64 for float64 inputs) in choice order and returns ``y``'s dtype, as
    DeepSpeed's decode does; weights of dropped routes are ignored. Differentiable in ``y`` and ``weight``.
    """
    _check_float("y", y)
    if y.dim() < 3:
        raise ValueError(f"y must be [E, C, M] (or [..., C, M]), got shape {tuple(y.shape)}")
    num_experts, capacity = math.prod(y.shape[:-2]), y.shape[-2]
    _check_index("expert_idx", expert_idx)
    _check_float("weight", weight, shape=tuple(expert_idx.shape))
    _check_routes(expert_idx, slot, num_experts, capacity, expert_idx.shape[0])
    _check_same_device(y=y, expert_idx=expert_idx, slot=slot, weight=weight)
    module = _resolve_impl(impl, y, weight, expert_idx)
    if module is not None:
        return CombineOp.apply(module, y, expert_idx.contiguous(), slot.contiguous(), weight)
    _flat_routes(expert_idx, slot, capacity)
    acc_dtype = torch.float64 if torch.float64 in (y.dtype, weight.dtype) else torch.float32
    y_rows = y.reshape(num_experts * capacity, y.shape[-1])
    out = torch.zeros(expert_idx.shape[0], y.shape[-1], dtype=acc_dtype, device=y.device)
    for j in range(expert_idx.shape[1]):  # k is small; one gather per choice keeps the sum in choice order
        token = (slot[:, j] >= 0).nonzero(as_tuple=True)[0]
        rows = expert_idx[token, j].long() * capacity + slot[token, j].long()
        part = y_rows.index_select(0, rows).to(acc_dtype) * weight[token, j].to(acc_dtype).unsqueeze(1)
        out = out.index_add(0, token, part)
    return out.to(y.dtype)


# --------------------------------------------------------------------------------------------- per expert
def dispatch_per_expert(x: torch.Tensor, expert_idx: torch.Tensor, slot: torch.Tensor, num_experts: int,
                        capacity: int, block_shape: tuple[int, ...], *,
                        impl: str | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`dispatch` into one buffer per expert: ``num_experts`` tensors of ``block_shape`` (``capacity``
    x M elements each, e.g. the ``[1, 1, C, M]`` an expert sees at ``ep_size=1``), each expert's rows.

    The MoE layer runs each expert on its own buffer and hands the outputs to :func:`combine_per_expert`, so
    no ``[E, C, M]`` tensor is split for the experts or concatenated after them (forward and backward: two
    copies and two fresh ``[E, C, M]`` allocations fewer per step). Differentiable in ``x``.
    """
    _check_float("x", x, ndim=2)
    check_int("num_experts", num_experts, 1)
    check_int("capacity", capacity, 0)
    if math.prod(block_shape) != capacity * x.shape[1] or not block_shape or block_shape[-1] != x.shape[1]:
        raise ValueError(f"block_shape must hold capacity x width ({capacity} x {x.shape[1]}), "
                         f"got {block_shape}")
    _check_routes(expert_idx, slot, num_experts, capacity, x.shape[0])
    _check_same_device(x=x, expert_idx=expert_idx, slot=slot)
    module = _resolve_impl(impl, x, expert_idx)
    if module is not None:
        return DispatchBlocksOp.apply(module, x, expert_idx.contiguous(), slot.contiguous(), num_experts,
                                       capacity, tuple(block_shape))
    buffer = dispatch(x, expert_idx, slot, num_experts, capacity, impl="torch")
    return tuple(b.reshape(block_shape) for b in buffer.unbind(0))


def combine_per_expert(ys: list[torch.Tensor] | tuple[torch.Tensor, ...], expert_idx: torch.Tensor,
                       slot: torch.Tensor, weight: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """:func:`combine` from one output per expert (each of ``capacity x M`` elements, last dim M), as
    :func:`dispatch_per_expert` hands them out. Differentiable in every ``ys[e]`` and ``weight``; the
    compiled backward writes each output's gradient over the output where nothing else can reach it."""
    if not ys:
        raise ValueError("ys must hold one tensor per expert, got none")
    for e, y in enumerate(ys):
        _check_float(f"ys[{e}]", y)
    width = ys[0].shape[-1]
    capacity = ys[0].numel() // width if width else 0
    if any(y.shape[-1] != width or y.numel() != capacity * width for y in ys):
        raise ValueError(f"ys must all hold the same rows of width {width}, "
                         f"got {[tuple(y.shape) for y in ys]}")
    if len({y.dtype for y in ys}) > 1:
        raise TypeError(f"ys must share one dtype, got {sorted({str(y.dtype) for y in ys})}")
    module = _resolve_impl(impl, *ys, weight, expert_idx)
    if module is None or width == 0:
        return combine(torch.stack([y.reshape(capacity, width) for y in ys]), expert_idx, slot, weight,
                       impl="torch" if module is None else impl)
    _check_index("expert_idx", expert_idx)
    _check_float("weight", weight, shape=tuple(expert_idx.shape))
    _check_routes(expert_idx, slot, len(ys), capacity, expert_idx.shape[0])
    _check_same_device(expert_idx=expert_idx, slot=slot, weight=weight,
                       **{f"ys[{e}]": y for e, y in enumerate(ys)})
    return CombineBlocksOp.apply(module, expert_idx.contiguous(), slot.contiguous(), weight, *ys)
