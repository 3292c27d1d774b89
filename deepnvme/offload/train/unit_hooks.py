"""The hooks of an offloaded unit: its forward wrapped (read before, freed after), a pre-hook on the
autograd node that made its outputs that tells the owner its backward begins, and one on the node that
made its inputs that tells it the backward is done (identity autograd functions instead where those
tensors are leaves; params.py says why the order is right)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from deepnvme.offload.train.held import HeldUnit

if TYPE_CHECKING:
    from deepnvme.offload.train.params import OffloadedParameters


class _BackwardBegins(torch.autograd.Function):
    """Identity on a unit's outputs that are leaves: its backward runs before any node of the unit."""

    @staticmethod
    def forward(ctx: Any, hook: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


class BackwardEnds(_BackwardBegins):
    """Identity on a unit's inputs that are leaves: its backward runs after every node of the unit."""


def through(fn: type[_BackwardBegins], hook: Any, tree: Any) -> Any:
    """`tree` (a tensor, or tuples, lists, dicts, model outputs of them) with its tensors that need a
    gradient passed through `fn` together (its backward runs once, when all their gradients are in)."""
    leaves, spec = pytree.tree_flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not at:
        return tree
    out = fn.apply(hook, *[leaves[i] for i in at])
    for i, t in zip(at, out):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


def wrap_unit(owner: OffloadedParameters, u: HeldUnit) -> None:
    """Replace `u`'s forward by one that has its parameters in memory while it runs."""
    mod = u.module
    u.had_forward = "forward" in mod.__dict__
    u.orig_forward = mod.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return run(owner, u, args, kwargs)

    mod.forward = forward


def unwrap_unit(u: HeldUnit) -> None:
    if u.orig_forward is None:
        return
    if u.had_forward:
        u.module.forward = u.orig_forward
    else:
        u.module.__dict__.pop("forward", None)
    u.orig_forward = None


# The key, in the metadata of the autograd node that made a tensor, of the events run before that node.
EVENTS_KEY = "deepnvme_gradient_events"
ENDS, BEGINS = 0, 1


def _on_gradient(t: torch.Tensor, order: int, fire: Any) -> None:
    """Run `fire()` just before the node that made `t` runs in a backward (when `t`'s gradient is
    complete). One pre-hook per node runs every event put on it, the ends of units' backwards before the
    beginnings: a tensor that is one unit's input and another's (or the same unit's, run again) output
    finishes the first before reading the second. Kept with the node, not the tensor: a tensor modified in
    place has a new node, and its events stay with the old one, where its gradient is complete."""
    node = t.grad_fn
    events = node.metadata.get(EVENTS_KEY)
    if events is None:
        events = node.metadata[EVENTS_KEY] = []

        def hook(_grads: Any) -> None:
            for _, f in sorted(events, key=lambda e: e[0]):
                f()

        node.register_prehook(hook)
    events.append((order, fire))


def _first_gradient(call: Any, u: HeldUnit, tree: Any, order: int) -> Any:
    """Have `call(u)` run once, when the first of the gradients of `tree`'s tensors that need one is
    complete (just before the node that made it runs); `tree` as the caller is to use it.

    A node's pre-hook adds nothing to the graph: the caller may modify the tensors in place (a unit's
    output) and an input also used outside the unit has its gradient summed in the order it has in memory.
    (torch's register_multi_grad_hook is not used: its hooks hold their tensors' nodes, a cycle through
    C++ that Python's collector cannot free, and memory grew every step.) A leaf has no such node (its
    gradient is accumulated, maybe before the unit's weight gradients are): a tree that holds a leaf
    passes through an identity function instead."""
    leaves = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return tree
    if any(t.grad_fn is None for t in leaves):
        return through(BackwardEnds if order == ENDS else _BackwardBegins, lambda: call(u), tree)
    fired = [None]

    def once() -> None:  # once per backward over this graph (retain_graph: again in the next one)
        task = torch._C._current_graph_task_id()
        if fired[0] != task:
            fired[0] = task
            call(u)

    for t in {id(t): t for t in leaves}.values():
        _on_gradient(t, order, once)
    return tree


def run(owner: OffloadedParameters, u: HeldUnit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One forward (or recompute) of unit `u`."""
    grad = torch.is_grad_enabled()
    with owner.lock:
        owner.enter(u)
    try:
        if grad:  # the unit's inputs: their gradients are complete after every node of the unit
            args, kwargs = _first_gradient(owner.backward_ends, u, (args, kwargs), ENDS)
        out = u.orig_forward(*args, **kwargs)
    finally:
        with owner.lock:
            owner.leave(u, grad)
    if grad:
        out = _first_gradient(owner.backward_begins, u, out, BEGINS)
    return out
