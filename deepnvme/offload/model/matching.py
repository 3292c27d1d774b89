"""A model matched to a store: for each tensor of the model, the store tensor that holds its values and where
it goes — into a unit (a `Slot` of it, filled while the unit runs) or resident (read once, outside every
unit). Works on a model built on the meta device (accelerate's init_empty_weights): only names, shapes
and dtypes are looked at, and the store's tensors are checked against them here, before anything is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepnvme.offload.model.names import find_tensor, tensor_slots
from deepnvme.offload.model.placeholder import Placeholder
from deepnvme.offload.stores import StoreError, TensorInfo, check_kind


@dataclass
class Slot:
    """One tensor of a unit: where it sits in the model and in the store."""

    module: nn.Module
    attr: str
    param: bool
    requires_grad: bool
    info: TensorInfo
    dtype: torch.dtype
    device: torch.device
    placeholder: Placeholder | None = None

    def put(self, t: Any) -> None:
        """Make `t` the module's parameter or buffer `attr` (a view, a placeholder, None)."""
        (self.module._parameters if self.param else self.module._buffers)[self.attr] = t


@dataclass
class Resident:
    """A tensor held outside every unit (by at least one of its names): read once into memory of its own and
    put in every `places` (module, attribute, is_param) that holds it."""

    tensor: torch.Tensor
    info: TensorInfo
    places: list[tuple[nn.Module, str, bool]]


def match_store(model: nn.Module, store_path: str, store_tensors: Mapping[str, TensorInfo],
                units: list[tuple[str, nn.Module]],
                skip: frozenset[int] | set[int] = frozenset()) -> tuple[list[list[Slot]], list[Resident]]:
    """The slots of each of `units` (in their order) and the residents of `model`, every tensor matched to
    its entry in the store at `store_path` (`store_tensors`). Tensors whose id is in `skip` are someone
    else's (the experts'). StoreError naming them when tensors of the model are not in the store (a
    non-persistent buffer on the meta device is named as such), or a tensor's shape or kind differs; a
    buffer the store does not hold and that has values stays as it is (rotary frequencies)."""
    unit_of = {n: k for k, (n, _) in enumerate(units)}  # module name prefix -> unit index
    slots: list[list[Slot]] = [[] for _ in units]
    residents: list[Resident] = []
    missing: list[str] = []
    for aliases in tensor_slots(model).values():
        full = [a[0] for a in aliases]
        mod0, attr0, is_param = aliases[0][2], aliases[0][3], aliases[0][4]
        t = (mod0._parameters if is_param else mod0._buffers)[attr0]
        if id(t) in skip:
            continue
        homes = [next((k for p, k in unit_of.items() if mname == p or mname.startswith(p + ".")), None)
                 for _, mname, *_ in aliases]
        info = find_tensor(store_tensors, model, full)
        if info is None:
            if is_param or t.is_meta:
                if not is_param and attr0 in mod0._non_persistent_buffers_set:
                    raise StoreError(f"buffer {full[0]!r} is on the meta device and no checkpoint holds it "
                                     "(a non-persistent buffer): build the model with accelerate's "
                                     "init_empty_weights (buffers stay real), not torch.device('meta')")
                missing.append(full[0])
            continue  # a buffer the store does not hold stays as it is (rotary frequencies)
        if tuple(t.shape) != info.shape:
            raise StoreError(f"tensor {info.name!r} in {info.path}: shape {info.shape} in the store, "
                             f"{tuple(t.shape)} in the model (a store for another model?)")
        check_kind(info, t.dtype, full[0])
        device = torch.device("cpu") if t.is_meta else t.device
        if None not in homes:  # tied across units (embeddings and head both streamed): read by each
            for k, (_, _, mod, attr, p) in zip(homes, aliases):
                slots[k].append(Slot(mod, attr, p, bool(t.requires_grad), info, t.dtype, device))
        else:
            residents.append(Resident(t, info, [(a[2], a[3], a[4]) for a in aliases]))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise StoreError(f"{len(missing)} tensors of the model are not in the store {store_path}: "
                         f"{', '.join(repr(n) for n in missing[:5])}{more} (a store for another model?)")
    return slots, residents


__all__ = ["Resident", "Slot", "match_store"]
