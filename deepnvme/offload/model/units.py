"""Which modules of a model are units (read in and given back as one): by default the ModuleList of repeated
blocks holding the most parameters (GPT-2's transformer.h, Llama's model.layers), or the ones a caller
names. Shared by streaming (deepnvme.offload.infer) and the store writer (write_store), so that a store's
blobs are the units streaming reads."""

from __future__ import annotations

from typing import Any

from torch import nn


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of repeated blocks holding the most parameters (GPT-2's transformer.h, Llama's
    model.layers)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(c) for c in mod}) == 1:
            n = sum(p.numel() * p.element_size() for p in mod.parameters())
            if n > 0 and (best is None or n > best[0]):
                best = (n, name, mod)
    if best is None:
        raise ValueError(f"no ModuleList of repeated blocks with parameters in {type(model).__name__}: pass "
                         "units= (the name of the module list, or a list of modules or module names)")
    return best[1], best[2]


def unit_modules(model: nn.Module, units: Any) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) of each unit of `model`: its repeated blocks when `units` is None (each
    block object once), the children of the module named `units`, or the modules (or module names)
    listed; ValueError or TypeError naming what is wrong (not a submodule, the model itself, nested units,
    a module named twice)."""
    names = {id(m): n for n, m in model.named_modules()}
    if units is None:
        # A block repeated as the same object (ALBERT's shared layers) is one unit, run several times.
        chosen: list[Any] = list({id(b): b for b in _blocks(model)[1]}.values())
    elif isinstance(units, str):
        try:
            container = model.get_submodule(units)
        except AttributeError:
            raise ValueError(f"units={units!r}: no such module in {type(model).__name__}") from None
        chosen = list(container.children())
        if not chosen:
            raise ValueError(f"units={units!r}: the module has no children to stream one by one")
    elif isinstance(units, (list, tuple)) and units:
        chosen = list(units)
    else:
        raise TypeError("units must be None, a module name or a non-empty list of modules or names, "
                        f"got {units!r}")
    out = []
    for c in chosen:
        if isinstance(c, str):
            try:
                c = model.get_submodule(c)
            except AttributeError:
                raise ValueError(f"units: no module named {c!r} in {type(model).__name__}") from None
        if not isinstance(c, nn.Module) or id(c) not in names:
            raise ValueError(f"units: {c!r} is not a submodule of the model")
        if c is model:
            raise ValueError("units: the model itself cannot be a unit (its blocks are)")
        out.append((names[id(c)], c))
    seen = [n for n, _ in out]
    for a in seen:
        for b in seen:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"units: {b!r} lies inside {a!r}; units must not nest")
    if len(set(seen)) != len(seen):
        raise ValueError("units: a module is named twice")
    return out


def unit_names(model: nn.Module, units: Any = None) -> list[str]:
    """The qualified names of the modules stream_weights makes units of (same `units` argument)."""
    return [n for n, _ in unit_modules(model, units)]
