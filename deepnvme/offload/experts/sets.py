"""Where a model's Mixture-of-Experts experts are, what each expert's tensors are called, and where a store
keeps them: what streaming needs to make every expert a unit of its own.

Two kinds of expert sets are found:

* ``modules``: a :class:`deepnvme.moe.experts.Experts`, recognised by its contract (one module per expert
  in ``deepspeed_experts``, as in DeepSpeed, and the ``before_run`` hook). Expert e is the module
  ``<set>.deepspeed_experts.<e>``; its tensors keep their names.
* ``fused``: a Hugging Face experts module of transformers 5 (Mixtral's ``MixtralExperts`` and its kin:
  ``num_experts`` and 3-D parameters such as ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], whose
  slice e along dim 0 is expert e; forward takes ``(hidden_states, top_k_index, top_k_weights)``). Expert
  e is named ``<set>.<e>``, its tensors ``<set>.<e>.<parameter>`` (the slice, shape without dim 0): that is
  how deepnvme's own store writes them, one blob per expert.

A store may keep a fused expert three ways, all mapped here (`expert_parts`): deepnvme's store (the
slices above), a fused checkpoint (the 3-D tensor: slice e is a contiguous byte range of it), or the
per-expert tensors that ``save_pretrained`` writes in transformers 5.24 (Mixtral: ``...block_sparse_moe.
experts.<e>.w1/w3/w2.weight``, gate_up = cat(w1, w3) along dim 0). The last mapping comes from the
model's own checkpoint conversion table in transformers (renamings, and per-expert lists merged along dim 0
then concatenated), read backwards; other conversions are refused with a StoreError naming the tensor.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from deepnvme.offload.model import conversions, find_tensor, plain_pattern
from deepnvme.offload.stores import StoreError, TensorInfo, check_kind

MODULES, FUSED = "modules", "fused"


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) along dim 0 of expert tensor `target` (the tensor's store name for this expert)
    come from store tensor `info`."""

    target: str
    start: int
    stop: int
    info: TensorInfo


@dataclass
class Slot:
    """One tensor of an expert: `name` (its store name), where it lives in the model (`module`, `attr`,
    `param`), and for a fused set the parameter it is a slice of (`fused`, the whole 3-D tensor)."""

    name: str
    module: nn.Module
    attr: str
    param: bool
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class ExpertSet:
    """The experts of one MoE layer (see the module docstring for the two kinds)."""

    name: str
    module: nn.Module
    kind: str
    num_experts: int
    params: tuple[str, ...] = ()  # fused: the per-expert parameters (dim 0 is the expert)

    def unit_name(self, e: int) -> str:
        return f"{self.name}.deepspeed_experts.{e}" if self.kind == MODULES else f"{self.name}.{e}"

    def slots(self, e: int) -> list[Slot]:
        """Expert e's tensors, in a fixed order."""
        if self.kind == FUSED:
            out = []
            for p in self.params:
                t = self.module._parameters[p]
                out.append(Slot(f"{self.unit_name(e)}.{p}", self.module, p, True, tuple(t.shape[1:]),
                                t.dtype))
            return out
        expert = self.module.deepspeed_experts[e]
        out = []
        for mname, mod in expert.named_modules():
            for is_param, tensors in ((True, mod._parameters), (False, mod._buffers)):
                for attr, t in tensors.items():
                    if t is not None:
                        rel = f"{mname}.{attr}" if mname else attr
                        out.append(Slot(f"{self.unit_name(e)}.{rel}", mod, attr, is_param, tuple(t.shape),
                                        t.dtype))
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the set holds (the fused parameters, or every expert module's tensors)."""
        if self.kind == FUSED:
            return [self.module._parameters[p] for p in self.params]
        return [*self.module.deepspeed_experts.parameters(), *self.module.deepspeed_experts.buffers()]


def _is_fused_experts(mod: nn.Module) -> tuple[str, ...] | None:
    n = getattr(mod, "num_experts", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None
    params = tuple(p for p, t in mod._parameters.items() if t is not None)
    if not params or any(mod._parameters[p].dim() < 2 or mod._parameters[p].shape[0] != n for p in params):
        return None
    try:
        names = list(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        return None
    if "top_k_index" not in names or "top_k_weights" not in names:
        return None
    if any(True for _ in mod.children() if any(True for _ in _.parameters())):
        return None  # an experts module of another shape (sub-modules with weights): not this contract
    return params


def _is_module_experts(mod: nn.Module) -> bool:
    """Whether `mod` keeps the contract of deepnvme.moe's Experts: one module per expert in the ModuleList
    ``deepspeed_experts`` (DeepSpeed's name), ``num_local_experts`` of them, and the ``before_run`` hook
    the MoE layer calls with the experts about to run. Recognised by that contract rather than by class, so
    that offload needs nothing from deepnvme.moe (it reaches the rest of deepnvme through _core only)."""
    experts = getattr(mod, "deepspeed_experts", None)
    n = getattr(mod, "num_local_experts", None)
    return (isinstance(experts, nn.ModuleList) and type(n) is int and n == len(experts)
            and hasattr(mod, "before_run"))


def find_expert_sets(model: nn.Module) -> list[ExpertSet]:
    """The expert sets of `model`, in named_modules() order (the order layers run in a transformer)."""
    out: list[ExpertSet] = []
    inside: list[str] = []
    for name, mod in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if _is_module_experts(mod):
            out.append(ExpertSet(name, mod, MODULES, mod.num_local_experts))
            inside.append(name)
            continue
        params = _is_fused_experts(mod)
        if params is not None:
            out.append(ExpertSet(name, mod, FUSED, mod.num_experts, params))
            inside.append(name)
    return out


def expert_unit_names(model: nn.Module) -> list[str]:
    """The unit prefix of every expert of `model` (for deepnvme's store: one blob per expert)."""
    return [s.unit_name(e) for s in find_expert_sets(model) for e in range(s.num_experts)]


def split_fused(model: nn.Module,
                tensors: list[tuple[list[str], torch.Tensor]]) -> list[tuple[list[str], torch.Tensor]]:
    """`tensors` ((names, tensor) of a model) with each fused expert parameter replaced by its per-expert
    slices under their store names, so a store writes one blob per expert."""
    fused = {}
    for s in find_expert_sets(model):
        if s.kind == FUSED:
            for p in s.params:
                fused[id(s.module._parameters[p])] = (s, p)
    out = []
    for names, t in tensors:
        hit = fused.get(id(t))
        if hit is None:
            out.append((names, t))
            continue
        s, p = hit
        out.extend(([f"{s.unit_name(e)}.{p}"], t[e]) for e in range(s.num_experts))
    return out


# ---------------------------------------------------------------------------------------------- store mapping
def _lookup(store_tensors: Mapping[str, TensorInfo], model: nn.Module, name: str) -> TensorInfo | None:
    """Store tensor `name` under any of the names a checkpoint may give it (stream_weights' lookup)."""
    return find_tensor(store_tensors, model, [name])


def _per_expert_sources(model: nn.Module, s: ExpertSet, param: str, e: int) -> list[str] | None:
    """Checkpoint names of the tensors that form slice e of fused parameter `param`, concatenated along
    dim 0, from the model's conversion table (None when the table has no plain entry for it)."""
    full = f"{s.name}.{param}"
    for conv in conversions(model):
        if type(conv).__name__ != "WeightConverter" or len(conv.target_patterns) != 1:
            continue
        target = conv.target_patterns[0]
        if not full.endswith(target.lstrip(".")) or not plain_pattern(target):
            continue
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in conv.operations]
        if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            continue
        base = full[: len(full) - len(target.lstrip("."))]
        names = []
        for src in conv.source_patterns:
            if not re.fullmatch(r"[\w.]*\*[\w.]*", src):
                break
            names.append(base.rstrip(".") + ("" if src.startswith(".") else ".") + src.replace("*", str(e))
                         if base else src.lstrip(".").replace("*", str(e)))
        else:
            return names
    return None


def expert_parts(model: nn.Module, s: ExpertSet, e: int, store_tensors: Mapping[str, TensorInfo],
                 store_path: str) -> list[Part]:
    """Where expert e of set `s` lies in a store (see the module docstring); StoreError naming the tensor
    and the store when a tensor is missing or its shape differs."""
    parts = []
    for slot in s.slots(e):
        info = store_tensors.get(slot.name)
        if info is not None:
            if info.shape != slot.shape:
                raise StoreError(f"tensor {slot.name!r} in {info.path}: shape {info.shape} in the store, "
                                 f"{slot.shape} in the model (a store for another model?)")
            parts.append(Part(slot.name, 0, slot.shape[0] if slot.shape else 1, info))
            continue
        if s.kind == MODULES:
            info = _lookup(store_tensors, model, slot.name)
            if info is None:
                raise StoreError(f"expert tensor {slot.name!r} is not in the store {store_path}")
            if info.shape != slot.shape:
                raise StoreError(f"tensor {info.name!r} in {info.path}: shape {info.shape} in the store, "
                                 f"{slot.shape} in the model (a store for another model?)")
            parts.append(Part(slot.name, 0, slot.shape[0] if slot.shape else 1, info))
            continue
        parts.extend(_fused_parts(model, s, e, slot, store_tensors, store_path))
    dtypes = {slot.name: slot.dtype for slot in s.slots(e)}
    for part in parts:
        check_kind(part.info, dtypes[part.target], part.target)
    return parts


def _fused_parts(model: nn.Module, s: ExpertSet, e: int, slot: Slot, store_tensors: Mapping[str, TensorInfo],
                 store_path: str) -> list[Part]:
    whole = _lookup(store_tensors, model, f"{s.name}.{slot.attr}")
    if whole is not None:  # a fused checkpoint: slice e is one contiguous range of the 3-D tensor
        if whole.shape != (s.num_experts, *slot.shape):
            raise StoreError(f"tensor {whole.name!r} in {whole.path}: shape {whole.shape} in the store, "
                             f"{(s.num_experts, *slot.shape)} in the model (a store for another model?)")
        step = whole.nbytes // s.num_experts
        info = TensorInfo(f"{whole.name}[{e}]", whole.path, whole.offset + e * step, step, whole.dtype,
                          slot.shape)
        return [Part(slot.name, 0, slot.shape[0], info)]
    sources = _per_expert_sources(model, s, slot.attr, e)
    if sources is None:
        raise StoreError(f"expert tensor {slot.name!r} (slice {e} of {s.name}.{slot.attr}) is not in the "
                         f"store {store_path}, fused or per expert")
    parts, row = [], 0
    for src in sources:
        info = _lookup(store_tensors, model, src)
        if info is None:
            raise StoreError(f"expert tensor {src!r} (part of {slot.name!r}) is not in the store "
                             f"{store_path}")
        rows = info.shape[0] if info.shape else 0
        if tuple(info.shape[1:]) != tuple(slot.shape[1:]) or row + rows > slot.shape[0]:
            raise StoreError(f"tensor {info.name!r} in {info.path}: shape {info.shape} does not fit rows "
                             f"{row}.. of {slot.name!r} {slot.shape} (a store for another model?)")
        parts.append(Part(slot.name, row, row + rows, info))
        row += rows
    if row != slot.shape[0]:
        raise StoreError(f"expert tensor {slot.name!r}: the store's parts {sources} give {row} rows of "
                         f"{slot.shape[0]} ({store_path})")
    return parts
