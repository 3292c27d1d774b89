"""write_store: a model (or a state dict) written as deepnvme's own store, ready for stream_weights.

The units are the model's: its repeated blocks as stream_weights picks them (deepnvme.offload.model), each
expert a unit of its own (deepnvme.offload.experts); for a state dict, the numbered blocks with the most
tensors. The bytes and the manifest are the stores floor's (stores/own_write.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from deepnvme.offload.experts import expert_unit_names, split_fused
from deepnvme.offload.model import tensor_aliases, unit_names
from deepnvme.offload.stores import write_units


def _default_units(names: Iterable[str]) -> list[str]:
    """Unit prefixes of a state dict: `<list>.<i>` for the list of numbered blocks with the most tensors."""
    counts: dict[str, set[str]] = {}
    for n in names:
        m = re.match(r"^(.*?)\.(\d+)\.", n)
        if m:
            counts.setdefault(m[1], set()).add(f"{m[1]}.{m[2]}")
    if not counts:
        return []
    best = max(counts, key=lambda k: len(counts[k]))
    return sorted(counts[best], key=lambda u: int(u.rsplit(".", 1)[1]))


def _named_tensors(obj: nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
    """(names, tensor) of each distinct tensor: tied ones once, under all their names."""
    if isinstance(obj, nn.Module):
        return [(names, t) for names, t in tensor_aliases(obj)]
    if not isinstance(obj, Mapping):
        raise TypeError(f"write_store takes a torch.nn.Module or a state dict, got {type(obj).__name__}")
    seen: dict[tuple, int] = {}
    out: list[tuple[list[str], torch.Tensor]] = []
    for name, t in obj.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape),
               t.stride()) if not t.is_meta and t.numel() else None
        if key is not None and key in seen:
            out[seen[key]][0].append(name)
            continue
        if key is not None:
            seen[key] = len(out)
        out.append(([name], t))
    return out


def write_store(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], directory: str | os.PathLike, *,
                units: list[str] | None = None) -> str:
    """Write the tensors of a model (or a state dict) as a deepnvme store in `directory` (created if
    needed; a store there is replaced atomically). `units`: the unit prefixes (module names such as
    "model.layers.3"; a tensor belongs to the longest prefix it starts with); by default a model's
    repeated blocks (as stream_weights picks them) or, for a state dict, the numbered blocks with the most
    tensors. Returns the directory (absolute)."""
    tensors = _named_tensors(model_or_state_dict)
    for names, t in tensors:
        if t.is_meta:
            raise ValueError(f"tensor {names[0]!r} is on the meta device: it has no values to write")
    if units is None:
        if isinstance(model_or_state_dict, nn.Module):
            units = unit_names(model_or_state_dict)
        else:
            units = _default_units(n for names, _ in tensors for n in names)
    if isinstance(model_or_state_dict, nn.Module):  # every expert a blob of its own (experts/sets.py)
        tensors = split_fused(model_or_state_dict, tensors)
        units = [*units, *expert_unit_names(model_or_state_dict)]
    prefixes = sorted(set(units), key=len, reverse=True)
    groups: dict[str, list[tuple[list[str], torch.Tensor]]] = {u: [] for u in [*units, ""]}
    for names, t in tensors:
        home = next((u for u in prefixes if names[0] == u or names[0].startswith(u + ".")), "")
        groups[home].append((names, t))
    return write_units(directory, groups)


__all__ = ["write_store"]
