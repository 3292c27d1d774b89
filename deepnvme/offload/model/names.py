"""How a model's modules and tensors map to units and to the names a store gives them.

Shared by streaming (stream.py), deepnvme's store writer (ownstore.py) and the expert mapping
(expert_sets.py), so that each of them asks one place which blocks are units (`unit_names`), which names a
tied tensor has (`tensor_aliases`) and under which name a checkpoint keeps a tensor (`checkpoint_names`,
from the model's transformers conversion table read backwards; `find_tensor`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from deepnvme.offload.store import TensorInfo


def _conversions(model: nn.Module) -> list[Any]:
    """The model's checkpoint conversion table in transformers (none for other models), looked up once per
    model class and type (transformers hands out a deep copy at each call)."""
    config = getattr(model, "config", None)
    if config is None or "transformers" not in type(model).__module__:
        return []
    return _conversions_of(type(model), getattr(config, "model_type", None), model)


_TABLES: dict[tuple[type, Any], list[Any]] = {}


def _conversions_of(cls: type, model_type: Any, model: nn.Module) -> list[Any]:
    key = (cls, model_type)
    if key not in _TABLES:
        try:
            from transformers.conversion_mapping import extract_weight_conversions_for_model

            _TABLES[key] = list(extract_weight_conversions_for_model(model) or [])
        except Exception:  # noqa: BLE001 - transformers missing or unable to map this model: no table
            _TABLES[key] = []
    return _TABLES[key]


def _plain(pattern: str) -> bool:
    return re.fullmatch(r"[\w.]+", pattern) is not None


def checkpoint_names(model: nn.Module, name: str) -> list[str]:
    """Names a checkpoint may give model tensor `name` (the name itself first), through the renamings in
    the model's transformers conversion table read backwards (Mixtral's ``.mlp.`` is
    ``.block_sparse_moe.`` in its checkpoints)."""
    out = [name]
    for conv in _conversions(model):
        if type(conv).__name__ != "WeightRenaming":
            continue
        src, dst = conv.source_patterns[0], conv.target_patterns[0]
        if _plain(src) and _plain(dst):
            out += [n.replace(dst, src) for n in out if dst in n]
    return list(dict.fromkeys(out))


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


def _unit_modules(model: nn.Module, units: Any) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    if units is None:
        chosen: list[Any] = list(_blocks(model)[1])
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


def _tensor_slots(model: nn.Module) -> dict[int, list[tuple[str, str, nn.Module, str, bool]]]:
    """Every tensor of the model by identity: its (full name, module name, module, attribute, is_param)."""
    out: dict[int, list[tuple[str, str, nn.Module, str, bool]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for is_param, tensors in ((True, mod._parameters), (False, mod._buffers)):
            for attr, t in tensors.items():
                if t is not None:
                    full = f"{mname}.{attr}" if mname else attr
                    out.setdefault(id(t), []).append((full, mname, mod, attr, is_param))
    return out


def tensor_aliases(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct tensor of the model (parameters and buffers) with all the names it has (tied weights
    have several)."""
    out = []
    for aliases in _tensor_slots(model).values():
        mod, attr, p = aliases[0][2], aliases[0][3], aliases[0][4]
        out.append(([a[0] for a in aliases], (mod._parameters if p else mod._buffers)[attr]))
    return out


def unit_names(model: nn.Module, units: Any = None) -> list[str]:
    """The qualified names of the modules stream_weights makes units of (same `units` argument)."""
    return [n for n, _ in _unit_modules(model, units)]


def find_tensor(store_tensors: Any, model: nn.Module, names: list[str]) -> TensorInfo | None:
    """The store's entry for a model tensor known by any of `names`: tried as is, through the checkpoint
    renamings (checkpoint_names) and with or without the model's `base_model_prefix`."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    for n in [c for x in names for c in checkpoint_names(model, x)]:
        candidates = [n]
        if prefix:
            candidates += [n[len(prefix) + 1:]] if n.startswith(prefix + ".") else [f"{prefix}.{n}"]
        for c in candidates:
            if c in store_tensors:
                return store_tensors[c]
    return None
