"""The compiled routing op as autograd Functions, for deepnvme.moe.routing: dispatch and combine into one
``[E, C, M]`` buffer or one buffer per expert. What each forward saves and when its backward lets it go (or
writes a gradient over memory nobody else can reach) is decided here; which path runs, and the argument
checks, are routing's.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["CombineBlocksOp", "CombineOp", "DispatchBlocksOp", "DispatchOp"]


class DispatchOp(torch.autograd.Function):
    """Compiled dispatch (a scatter of token rows); its backward gathers each token's rows back and sums them.

    Saves only the routes: the copy itself needs no data for its gradient.
    """

    @staticmethod
    def forward(ctx: Any, module: Any, x: torch.Tensor, expert_idx: torch.Tensor, slot: torch.Tensor,
                num_experts: int, capacity: int) -> torch.Tensor:
        ctx.module = module
        ctx.save_for_backward(expert_idx, slot)
        return module.scatter(x.contiguous(), expert_idx, slot, num_experts, capacity)

    @staticmethod
    @once_differentiable  # the compiled backward is not itself differentiable: say so instead of a wrong 0
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        expert_idx, slot = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[1]:
            grad = grad_out.contiguous()
            grad_x = ctx.module.gather([grad], expert_idx, slot, grad.shape[0], grad.shape[1])
        return None, grad_x, None, None, None, None


class CombineOp(torch.autograd.Function):
    """Compiled combine (a weighted gather of buffer rows).

    Backward: the weights' gradient needs the expert outputs ``y`` (one dot product per route), the gradient
    of ``y`` needs only the weights (a weighted scatter), and each buffer row belongs to one route. The saved
    tensors are released first (unless the graph is kept for another backward). Then, when nothing else can
    reach ``y``'s memory any more (:func:`_sole_owner`), one pass takes each row's dot product and overwrites
    the row with its gradient, which is returned as ``y``'s gradient: no second ``[E, C, M]`` buffer, and no
    fresh pages to fault in. Otherwise the dots come first, ``y`` is let go, and the gradient is a new
    buffer; either way the step's peak holds one ``[E, C, M]`` buffer here, not two.
    """

    @staticmethod
    def forward(ctx: Any, module: Any, y: torch.Tensor, expert_idx: torch.Tensor, slot: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
        ctx.module = module
        ctx.y_shape = y.shape
        y = y.contiguous()
        weight = weight.contiguous()
        ctx.save_for_backward(y, expert_idx, slot, weight)
        buffer = _as_buffer(y)
        return module.gather([buffer], expert_idx, slot, buffer.shape[0], buffer.shape[1], weight)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        y, expert_idx, slot, weight = ctx.saved_tensors
        _release_saved_tensors(ctx)
        grad_out = grad_out.contiguous()
        need_y, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[4]
        grad_y = grad_w = None
        if need_y and grad_out.dtype == y.dtype and _sole_owner(y):
            buffer = _as_buffer(y)
            grad_w = ctx.module.scatter_over([buffer], grad_out, expert_idx, slot, buffer.shape[0],
                                             buffer.shape[1], weight, need_w)
            torch.autograd.graph.increment_version(y)  # its values changed under the same tensor
            grad_y = y
        else:
            buffer = _as_buffer(y)
            num_experts, capacity = buffer.shape[0], buffer.shape[1]
            if need_w:
                grad_w = ctx.module.route_dots(grad_out, [buffer], expert_idx, slot, num_experts, capacity)
            del y, buffer  # the last references to y's memory, if the combine held them
            if need_y:
                grad_y = ctx.module.scatter(grad_out, expert_idx, slot, num_experts, capacity, weight)
                grad_y = grad_y.view(ctx.y_shape)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return None, grad_y, None, None, grad_w


def _as_buffer(y: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[..., C, M]`` tensor viewed as the ``[E, C, M]`` buffer the op takes."""
    return y if y.dim() == 3 else y.view(math.prod(y.shape[:-2]), y.shape[-2], y.shape[-1])


def _release_saved_tensors(ctx: Any) -> None:
    """Drop ``ctx``'s saved tensors now instead of after its backward returns, unless the graph is kept
    (``retain_graph``/``create_graph``), when a later backward still needs them. The hook is torch's own
    (AOT autograd calls it the same way); without it the tensors are simply freed at the usual time.
    """
    release = getattr(ctx, "maybe_clear_saved_tensors", None)
    if release is not None:
        release()


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether the caller's one local name is the only way left to ``t``'s memory, so overwriting it is
    invisible to everyone else.

    Every way to reach the memory is counted: other C++ holders of the tensor (a saved variable that was not
    released, e.g. under ``retain_graph``, or another node that saved it), other tensors on the same storage
    (views, ``detach()`` aliases, a view's base), and other Python references to the tensor object (a user
    variable, a forward hook's stash). Leaves are the user's and never qualify. Any doubt, including torch
    internals this relies on going away, answers False, which costs only a fresh buffer.
    """
    if t._base is not None or t.is_leaf or not t.is_contiguous():
        return False
    try:
        if t._use_count() != 1:
            return False
        storage = t.untyped_storage()
        holders = torch._C._storage_Use_Count(storage._cdata) - 1  # less our own storage object
        del storage
    except (AttributeError, RuntimeError):
        return False
    # References to t: the caller's local, this argument and getrefcount's own argument.
    return holders == 1 and sys.getrefcount(t) == 3


class DispatchBlocksOp(torch.autograd.Function):
    """Compiled dispatch into one new buffer per expert; backward gathers the per-expert gradients (a missing
    one, from an expert output nobody used, reads as zeros)."""

    @staticmethod
    def forward(ctx: Any, module: Any, x: torch.Tensor, expert_idx: torch.Tensor, slot: torch.Tensor,
                num_experts: int, capacity: int, block_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        ctx.module = module
        ctx.set_materialize_grads(False)  # no zero [C, M] tensors for unused experts
        ctx.shape = (num_experts, capacity, x.shape[0], x.shape[1], x.dtype)
        ctx.save_for_backward(expert_idx, slot)
        blocks = module.scatter_blocks(x.contiguous(), expert_idx, slot, num_experts, capacity, block_shape)
        return tuple(blocks)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        expert_idx, slot = ctx.saved_tensors
        num_experts, capacity, tokens, width, dtype = ctx.shape
        grad_x = None
        if ctx.needs_input_grad[1]:
            blocks = [None if g is None else g.contiguous() for g in grads]
            if all(b is None for b in blocks):
                grad_x = torch.zeros(tokens, width, dtype=dtype)
            else:
                grad_x = ctx.module.gather(blocks, expert_idx, slot, num_experts, capacity)
        return None, grad_x, None, None, None, None, None


class CombineBlocksOp(torch.autograd.Function):
    """Compiled combine from one output per expert; backward as :class:`CombineOp`'s: when
    :func:`_sole_owner` allows it for every output, one pass takes the weight dots and writes each output's
    gradient over it; otherwise the dots come first and the outputs nobody else holds still take their
    gradients, the others get new tensors."""

    @staticmethod
    def forward(ctx: Any, module: Any, expert_idx: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
                *ys: torch.Tensor) -> torch.Tensor:
        ctx.module = module
        ys = tuple(y.contiguous() for y in ys)
        ctx.save_for_backward(expert_idx, slot, weight.contiguous(), *ys)
        capacity = ys[0].numel() // ys[0].shape[-1]
        return module.gather(list(ys), expert_idx, slot, len(ys), capacity, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        expert_idx, slot, weight, *ys = ctx.saved_tensors
        _release_saved_tensors(ctx)
        grad_out = grad_out.contiguous()
        num_experts = len(ys)
        capacity = ys[0].numel() // ys[0].shape[-1]
        need_w = ctx.needs_input_grad[3]
        need_y = [ctx.needs_input_grad[4 + e] for e in range(num_experts)]
        owned = []
        for e in range(num_experts):
            y, ys[e] = ys[e], None  # only `y` refers to it now, unless someone else does
            owned.append(need_y[e] and y.dtype == grad_out.dtype and _sole_owner(y))
            ys[e] = y
            del y
        grad_w = None
        if all(owned):  # one pass: each row's dot product, then its gradient over it
            for y in ys:
                torch.autograd.graph.increment_version(y)  # its values change under the same tensor
            grad_w = ctx.module.scatter_over(ys, grad_out, expert_idx, slot, num_experts, capacity, weight,
                                             need_w)
            targets = ys
        else:
            if need_w:
                grad_w = ctx.module.route_dots(grad_out, ys, expert_idx, slot, num_experts, capacity)
            if not any(need_y):
                return (None, None, None, None if grad_w is None else grad_w.to(weight.dtype),
                        *([None] * num_experts))
            targets = []
            for e in range(num_experts):
                y, ys[e] = ys[e], None
                if owned[e]:
                    torch.autograd.graph.increment_version(y)
                    targets.append(y)
                else:
                    targets.append(torch.empty_like(y, memory_format=torch.contiguous_format))
                del y  # the last reference to an output it did not own, if the combine held that
            ctx.module.scatter_over(targets, grad_out, expert_idx, slot, num_experts, capacity, weight, False)
        grads = [t if need else None for t, need in zip(targets, need_y)]
        return (None, None, None, None if grad_w is None else grad_w.to(weight.dtype), *grads)
