"""Under which names a model's tensors are known: in the model (every tensor by identity with all its names,
`tensor_slots`; tied tensors once with their names, `tensor_aliases`) and in a checkpoint
(`checkpoint_names`, from the model's transformers conversion table read backwards, `conversions`;
`find_tensor` looks a model tensor up in a store).

Shared by streaming (deepnvme.offload.infer), the store writer (write_store) and the expert mapping
(deepnvme.offload.experts), so that each of them asks one place.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from deepnvme.offload.stores import TensorInfo


def conversions(model: nn.Module) -> list[Any]:
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


def plain_pattern(pattern: str) -> bool:
    """Whether a conversion pattern is a plain dotted name (no regular expression): only those are read
    backwards."""
    return re.fullmatch(r"[\w.]+", pattern) is not None


def checkpoint_names(model: nn.Module, name: str) -> list[str]:
    """Names a checkpoint may give model tensor `name` (the name itself first), through the renamings in
    the model's transformers conversion table read backwards (Mixtral's ``.mlp.`` is
    ``.block_sparse_moe.`` in its checkpoints)."""
    out = [name]
    for conv in conversions(model):
        if type(conv).__name__ != "WeightRenaming":
            continue
        src, dst = conv.source_patterns[0], conv.target_patterns[0]
        if plain_pattern(src) and plain_pattern(dst):
            out += [n.replace(dst, src) for n in out if dst in n]
    return list(dict.fromkeys(out))


def tensor_slots(model: nn.Module) -> dict[int, list[tuple[str, str, nn.Module, str, bool]]]:
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
    for aliases in tensor_slots(model).values():
        mod, attr, p = aliases[0][2], aliases[0][3], aliases[0][4]
        out.append(([a[0] for a in aliases], (mod._parameters if p else mod._buffers)[attr]))
    return out


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
