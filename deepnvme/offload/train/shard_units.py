"""The units of a model offloaded by offload_shards: each module torch's `fully_shard` was applied to, with
the parameters its own group shards (fsdp_groups), and what the owner keeps of one (ShardUnit): its
parameter shards' and gradients' memory (shard_parts.Parts) and where on the drive they go."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from deepnvme.offload.swap import Unit
from deepnvme.offload.train.dtensors import is_dtensor
from deepnvme.offload.train.shard_parts import Parts, storages_of

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without distributed support
    FSDPModule = None  # type: ignore[assignment,misc]

# The ShardUnit of each offloaded DTensor parameter (for the optimizer's step); kept beside the parameters,
# not on them, so that they pickle and copy as FSDP's own do.
_UNITS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def unit_of(p: torch.Tensor) -> ShardUnit | None:
    """The ShardUnit whose shards include parameter `p` (None when `p` is not offloaded by offload_shards)."""
    return _UNITS.get(p)


class ShardUnit:
    """One module FSDP2 shards as a group: its parameters' shards, their gradients, and their leases."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.index, self.name, self.module, self.params = index, name, module, params
        self.data = Parts(f"shards.{index}", storages_of(p.to_local() for p in params))
        self.grads: Parts | None = None
        self.data_unit: Unit | None = None  # where the parameter shards go
        self.grad_unit: Unit | None = None  # where gradients go (kept while they are set to None)
        self.in_backward = -1  # the graph task of the backward it is in (-1: none)
        self.handles: list[Any] = []
        self.owner: Any = None  # the OffloadedShards

    def claim(self) -> None:
        """Make this the unit unit_of() names for each of its parameters."""
        for p in self.params:
            _UNITS[p] = self

    def unclaim(self) -> None:
        for p in self.params:
            _UNITS.pop(p, None)

    def local_grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.params if p.grad is not None]

    def tensors(self, parts: Parts) -> list[torch.Tensor]:
        """The local tensors over `parts`' storages (the shards, or their gradients)."""
        if parts is self.data:
            with torch.no_grad():
                return [p.to_local() for p in self.params]
        return self.local_grads()


def fsdp_groups(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Every module fully_shard was applied to (in the model's order, the same on every rank), with the
    parameters its own group shards (those of its submodules that are not such modules themselves)."""
    if FSDPModule is None or not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module sharded by torch's fully_shard, got "
                        f"{type(model).__name__}")
    groups = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not groups:
        raise ValueError("model has no module sharded by torch.distributed.fsdp.fully_shard: shard it first "
                         "(fully_shard on each block, then on the model), then offload its shards")
    inner = {id(m) for _, m in groups}
    out = []
    for name, m in groups:
        own: list[nn.Parameter] = []
        stack = [m]
        while stack:
            mod = stack.pop()
            own += [p for p in mod._parameters.values() if p is not None]
            stack += [c for c in mod.children() if id(c) not in inner]
        out.append((name or "(root)", m, list({id(p): p for p in own}.values())))
    return out


def plan_units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The modules fully_shard was applied to, each with the parameters its own group shards (units
    without an element on this rank left out)."""
    plans = []
    for name, m, own in fsdp_groups(model):
        for p in own:
            if not is_dtensor(p):
                raise ValueError(f"a parameter of {name} is not sharded by fully_shard "
                                 f"({type(p).__name__}): offload_shards offloads FSDP2's shards")
            if p.device.type not in ("cpu", "meta") or p.device_mesh.device_type != "cpu":
                raise ValueError(f"a parameter of {name} is on {p.device}, computed on "
                                 f"{p.device_mesh.device_type}: offload_shards keeps the shards of models "
                                 "computed on the host only (CUDA is not supported yet)")
            if unit_of(p) is not None:
                raise ValueError(f"the shards of {name} are offloaded already")
        if own and any(p.to_local().numel() for p in own):
            plans.append((name, m, own))
    if not plans:
        raise ValueError("no shard of model holds any element on this rank: nothing to offload")
    return plans


def shard_bytes(p: torch.Tensor) -> int:
    """Bytes of FSDP2's padded shard of `p` on this rank (its storage: every rank's is the first's size)."""
    local = p.to_local()  # type: ignore[attr-defined]
    if local.dim() == 0 or p.shape[0] == 0:
        return local.numel() * local.element_size()
    ranks = p.device_mesh.size()  # type: ignore[attr-defined]
    return -(-p.shape[0] // ranks) * (p.numel() // p.shape[0]) * p.element_size()


def check_buffers(model: nn.Module) -> None:
    """A checkpoint fills parameters; a buffer on the meta device would be garbage in the forward."""
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(f"buffer {name} is on the meta device: build the model with its buffers in "
                             "memory (accelerate's init_empty_weights does), then fill its shards from the "
                             "checkpoint")


__all__ = ["ShardUnit", "check_buffers", "fsdp_groups", "plan_units", "shard_bytes", "unit_of"]
