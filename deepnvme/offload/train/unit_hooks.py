"""The hooks of an offloaded unit: its forward wrapped (read before, freed after), an identity autograd
function on its outputs that tells the owner its backward begins, and a gradient hook on its inputs (or,
for inputs that are leaves, another identity) that tells it the backward is done (params.py says why
their order is right)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from deepnvme.offload.train.held import HeldUnit

if TYPE_CHECKING:
    from deepnvme.offload.train.params import OffloadedParameters


class _BackwardBegins(torch.autograd.Function):
    """Identity on a unit's outputs: its backward runs before any node of the unit."""

    @staticmethod
    def forward(ctx: Any, hook: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


class _BackwardEnds(_BackwardBegins):
    """Identity on a unit's inputs: its backward runs after every node of the unit."""


def _through(fn: type[_BackwardBegins], hook: Any, tree: Any) -> Any:
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


def _when_done(owner: OffloadedParameters, u: HeldUnit, args: Any) -> Any:
    """Have `owner.backward_ends(u)` called once the unit's backward is done; the inputs as the unit is to
    see them.

    Inputs made by autograd nodes get a gradient hook, run just before the node that made them runs: after
    every node of the unit, all made later (the first input's to run is enough), and nothing is added to
    the graph, so an input also used outside the unit has its gradient summed in the order it has in
    memory. (torch's register_multi_grad_hook is not used: its hooks hold the inputs' nodes, a cycle
    through C++ that Python's collector cannot free, and memory grew every step.) A leaf input cannot have
    one (its hook runs at accumulation, which may come before the unit's weight gradients are
    accumulated): inputs that include a leaf pass through _BackwardEnds instead."""
    leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return args
    if any(t.grad_fn is None for t in leaves):
        return _through(_BackwardEnds, lambda: owner.backward_ends(u), args)
    fired = [False]

    def hook(_grad: torch.Tensor) -> None:
        if not fired[0]:
            fired[0] = True
            owner.backward_ends(u)

    for t in {id(t): t for t in leaves}.values():
        t.register_hook(hook)
    return args


def run(owner: OffloadedParameters, u: HeldUnit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One forward (or recompute) of unit `u`."""
    grad = torch.is_grad_enabled()
    with owner.lock:
        owner.enter(u)
    try:
        if grad:
            args, kwargs = _when_done(owner, u, (args, kwargs))
        out = u.orig_forward(*args, **kwargs)
    finally:
        with owner.lock:
            owner.leave(u, grad)
    if grad:
        out = _through(_BackwardBegins, lambda: owner.backward_begins(u), out)
    return out
