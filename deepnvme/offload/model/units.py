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


def row_readable(model: nn.Module, mod: Any) -> bool:
    """Whether `mod`, the model's input embeddings, can be read by rows (deepnvme.offload.infer.rows): a
    plain nn.Embedding (a subclass's forward may do more than look up) without max_norm (which rewrites
    the table as it looks up) whose weight no other module holds (a tied head)."""
    if type(mod) is not nn.Embedding or mod.max_norm is not None:
        return False
    w = mod._parameters.get("weight")
    return w is not None and not any(m is not mod and any(t is w for t in m._parameters.values())
                                     for m in model.modules())


def _table_bytes(mod: nn.Module, skip: frozenset[int] | set[int] = frozenset()) -> int:
    return sum(p.numel() * p.element_size() for p in mod.parameters() if id(p) not in skip)


def table_units(model: nn.Module, chosen: list[tuple[str, nn.Module]], embeddings: bool | None,
                budget: int, room: int | None = None,
                skip: frozenset[int] | set[int] = frozenset()) -> list[tuple[str, nn.Module]]:
    """The input embeddings and the output head (what Hugging Face's `get_input_embeddings()` and
    `get_output_embeddings()` give) to stream as units of their own beside `chosen`: both when
    `embeddings` is True, none when False; input embeddings that can be read by rows (row_readable) never
    are units. None (auto): only when they do not fit, that is when `budget` plus the tables would take
    more than `room` (the bytes the process may still take; None: unknown, nothing streamed); then each
    table that holds more bytes than the largest of `chosen` and fits `budget`, the largest first, until
    the rest fits. Why not always: a head streamed is read whole for every token, as much as a block,
    while kept in memory it costs nothing per token. A table inside a chosen unit, or the same module
    twice (an encoder-decoder's shared table), is taken once or not at all. Blocks are weighed without the
    tensors whose id is in `skip` (experts, streamed on their own). ValueError when True and the model has
    neither method."""
    if embeddings is False:
        return []
    if embeddings is not None and not isinstance(embeddings, bool):
        raise TypeError(f"embeddings must be True, False or None (auto), got {embeddings!r}")
    names = {id(m): n for n, m in model.named_modules()}
    found = []
    for method in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, method, None)
        mod = get() if callable(get) else None
        if method == "get_input_embeddings" and row_readable(model, mod):
            continue  # read by rows instead (deepnvme.offload.infer.rows), or resident
        if isinstance(mod, nn.Module) and id(mod) in names and mod is not model:
            found.append((names[id(mod)], mod))
    if embeddings and not found and not row_readable(model, getattr(model, "get_input_embeddings",
                                                                   lambda: None)()):
        raise ValueError(f"embeddings=True: {type(model).__name__} has no get_input_embeddings() or "
                         "get_output_embeddings(); list the tables in units= instead")
    taken = {n for n, _ in chosen}
    tables = []
    for name, mod in found:
        if any(name == t or name.startswith(t + ".") for t in taken) or not _table_bytes(mod):
            continue
        if all(m is not mod for _, m in tables):
            tables.append((name, mod))
            taken.add(name)
    if embeddings:
        return tables
    largest = max((_table_bytes(m, skip) for _, m in chosen), default=0)
    # Tables that share a weight (a head tied to the input table) go together: one of them alone would
    # leave the weight in memory for the other.
    groups: list[list[tuple[str, nn.Module]]] = []
    for t in tables:
        ids = {id(p) for p in t[1].parameters()}
        home = next((g for g in groups if any(id(p) in ids for _, m in g for p in m.parameters())), None)
        if home is None:
            groups.append([t])
        else:
            home.append(t)
    resident = sum(_table_bytes(g[0][1]) for g in groups)
    out: list[tuple[str, nn.Module]] = []
    for g in sorted(groups, key=lambda g: -_table_bytes(g[0][1])):
        if room is None or budget + resident <= room:
            break
        if largest < _table_bytes(g[0][1]) <= budget:
            out.extend(g)
            resident -= _table_bytes(g[0][1])
    return out


def unit_names(model: nn.Module, units: Any = None) -> list[str]:
    """The qualified names of the modules stream_weights makes units of (same `units` argument)."""
    return [n for n, _ in unit_modules(model, units)]
