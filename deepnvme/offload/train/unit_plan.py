"""Which parameters of a model offload_parameters takes into each unit, what a training step of it needs
in memory, and which parameters it cannot take."""

from __future__ import annotations

from typing import Any

from torch import nn


def plan_units(model: nn.Module, chosen: list[tuple[str, nn.Module]],
          meta_ok: bool) -> list[list[tuple[str, nn.Parameter]]]:
    """For each unit, the (qualified name, parameter) it offloads: those found only inside it. ValueError
    (check_param) for a parameter it cannot take, or one that gets sparse gradients."""
    # Every place of every module (a module registered in several places is seen in each): a parameter is
    # in a unit where a module above it, or its own, is that unit's module.
    unit_of = {id(mod): i for i, (_, mod) in enumerate(chosen)}
    paths = dict(model.named_modules(remove_duplicate=False))
    where: dict[int, set[int]] = {}
    sparse: set[int] = set()  # parameters whose gradients autograd makes sparse
    for path, m in paths.items():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            sparse.update(id(p) for p in m._parameters.values() if p is not None)
        parts = path.split(".") if path else []
        i = next((unit_of[id(paths[".".join(parts[:k])])] for k in range(1, len(parts) + 1)
                  if id(paths[".".join(parts[:k])]) in unit_of), -1)
        for p in m._parameters.values():
            if p is not None:
                where.setdefault(id(p), set()).add(i)
    out: list[list[tuple[str, nn.Parameter]]] = [[] for _ in chosen]
    for name, p in model.named_parameters(remove_duplicate=True):
        places = where[id(p)]
        if len(places) == 1 and -1 not in places:
            check_param(name, p, meta_ok)
            if id(p) in sparse and p.requires_grad:
                raise ValueError(f"{name} gets sparse gradients (its module has sparse=True): "
                                 "offload_parameters writes dense gradients only; make the module with "
                                 "sparse=False, or leave it out of the units (it then stays in memory, for "
                                 "an optimizer in memory such as torch.optim.SparseAdam to step)")
            out[next(iter(places))].append((name, p))
    return out


def memory_need(model: nn.Module, plan: list[list[tuple[str, nn.Parameter]]]) -> int:
    """Memory a training step takes beyond the pool and what the process holds now: the largest unit's
    parameters and gradients twice (a unit's new tensors are made while the last ones are let go, and a
    gradient read from the drive meets the one autograd makes), the gradients of parameters that stay in
    memory, and those parameters themselves when they are yet to be made (meta)."""
    def size(p: nn.Parameter) -> int:
        return p.numel() * p.element_size()

    offloaded = {id(p) for ps in plan for _, p in ps}
    data = max((sum(size(p) for _, p in ps) for ps in plan), default=0)
    grads = max((sum(size(p) for _, p in ps if p.requires_grad) for ps in plan), default=0)
    resident = [p for p in model.parameters() if id(p) not in offloaded]
    return (2 * (data + grads) + sum(size(p) for p in resident if p.requires_grad)
            + sum(size(p) for p in resident if p.is_meta))


def check_param(name: str, p: nn.Parameter, meta_ok: bool) -> None:
    if p.is_meta and meta_ok:
        return
    if p.is_meta:
        raise ValueError(f"{name} is on the meta device: give checkpoint= (the values to fill it with), or "
                         "fill the model before offloading it")
    if p.device.type != "cpu":
        raise ValueError(f"{name} is on {p.device}: offload_parameters keeps host parameters only for now "
                         "(a CUDA model's parameters offloaded through host memory are not built yet)")
    if not p.is_contiguous() or p.storage_offset() != 0 or p.untyped_storage().nbytes() != (
            p.numel() * p.element_size()):
        raise ValueError(f"{name} does not own its storage whole (a view of a larger tensor, or not "
                         "contiguous): offload_parameters frees each parameter's storage between uses; "
                         "give it a storage of its own (param.data = param.data.clone())")


def dense_grads(held: list[Any]) -> list[Any]:
    """`held` (a unit's parameters whose backward made gradients), after checking that no gradient is sparse
    (a module switched to sparse=True, or unfrozen, after offload_parameters refused or passed it): a
    RuntimeError naming the parameter, before anything is written."""
    for h in held:
        if h.real.grad.is_sparse:
            raise RuntimeError(f"{h.name} got a sparse gradient: offload_parameters writes dense gradients "
                               "only (make its module with sparse=False)")
    return held
