"""Parameters sharded by torch's FSDP2 (`fully_shard`: DTensors) stepped by OffloadedOptimizer through
each rank's local shard.

A DTensor parameter's values on this rank are its local tensor, a view of FSDP's shard memory; torch's
optimizers step a DTensor by running their kernels on the local shards, element by element. The offloaded
optimizer lays its swapped state out by each tensor's shape and steps tiles of plain tensors, so it steps
each DTensor through a *view*: a plain tensor over the same memory as the local shard, whose gradient is
the local shard of the DTensor's gradient. The arithmetic is the one torch's optimizer runs on the shards,
and the state on this rank's drive is this rank's share only.

The views take the DTensors' places in the wrapped optimizer's param groups (so `opt.param_groups` holds
plain tensors: the rank's shards). Before each step they are pointed at the local shards again (FSDP
replaces a local tensor when the model is converted or loaded with `assign=True`) and given the
gradients; zero_grad() clears the DTensors' gradients too. A DTensor added later (`add_param_group`) gets
its view at the next step.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # torch builds without distributed support have no DTensor: then there is nothing to view
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - every torch this project supports has it
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(p: Any) -> bool:
    """Whether `p` is a DTensor (a parameter sharded by FSDP2 or tensor parallelism)."""
    return DTensor is not None and isinstance(p, DTensor)


class ShardViews:
    """The plain views an optimizer steps in place of its DTensor parameters (see the module docstring)."""

    def __init__(self) -> None:
        self.dtensor_of: dict[int, torch.Tensor] = {}  # id(view) -> the DTensor it stands for
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (view, DTensor)
        self._view_by_id: dict[int, torch.Tensor] = {}  # id(DTensor) -> its view

    def __len__(self) -> int:
        return len(self._views)

    @torch.no_grad()
    def view_of(self, p: torch.Tensor) -> torch.Tensor:
        """The view standing for `p` (made on first use); `p` itself when it is not a DTensor."""
        if not is_dtensor(p):
            return p
        view = self._view_by_id.get(id(p))
        if view is not None and self.dtensor_of[id(view)] is p:
            return view
        view = p.to_local().detach()
        self._views.append((view, p))
        self.dtensor_of[id(view)] = p
        self._view_by_id[id(p)] = view
        return view

    def viewed(self, p: torch.Tensor) -> torch.Tensor | None:
        """The view standing for DTensor `p`, None when it has none."""
        view = self._view_by_id.get(id(p))
        return view if view is not None and self.dtensor_of.get(id(view)) is p else None

    def take(self, groups: list[dict[str, Any]]) -> None:
        """Put a view in place of each DTensor in `groups` (a DTensor already viewed keeps its view)."""
        for g in groups:
            if any(is_dtensor(p) for p in g["params"]):
                g["params"] = [self.view_of(p) for p in g["params"]]

    def give_back(self, groups: list[dict[str, Any]]) -> None:
        """Put each DTensor back in place of its view in `groups` (undoes take)."""
        for g in groups:
            g["params"] = [self.dtensor_of.get(id(p), p) for p in g["params"]]

    @torch.no_grad()
    def sync(self, only: list[torch.Tensor] | None = None) -> None:
        """Point every view (of the DTensors `only`, when given) at its DTensor's local shard and give it
        the local shard of its gradient."""
        wanted = None if only is None else {id(p) for p in only}
        for view, p in self._views:
            if wanted is not None and id(p) not in wanted:
                continue
            local = p.to_local()
            if (view.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
                    or view.storage_offset() != local.storage_offset() or view.shape != local.shape
                    or view.stride() != local.stride() or view.dtype != local.dtype):
                view.set_(local.untyped_storage(), local.storage_offset(), local.shape, local.stride())
            view.grad = None if p.grad is None else p.grad.to_local()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool) -> None:
        """zero_grad() of the DTensors behind the views (the views' own are the optimizer's to clear)."""
        for view, p in self._views:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
            view.grad = None


def local_state(sd: Any) -> Any:
    """An optimizer state_dict whose DTensor state (saved from an optimizer stepped over FSDP2's parameters
    in memory) is given as this rank's local shards, as the views of those parameters are stepped;
    anything else unchanged."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict):
        return sd
    state = {k: {key: v.to_local() if is_dtensor(v) else v for key, v in st.items()} if isinstance(st, dict)
             else st for k, st in sd["state"].items()}
    return {**sd, "state": state}
