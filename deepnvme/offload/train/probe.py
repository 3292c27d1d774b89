"""The state an optimizer will make for a parameter, learnt before it is made: one step on the meta device.

The swap space is sized, and checked against the budget and the drive's free space, before the first step
moves anything; for that the layout of each parameter's state (its tensors' keys, shapes and dtypes) must
be known before the optimizer makes it. The optimizer's own step is run once on an empty "meta" tensor of
the parameter's shape and dtype (no memory, no arithmetic; tensors it makes without naming a device are
made there too), in a group with the parameter's
hyperparameters, with the kernel choices that do not change the state (foreach, fused, capturable) off
since the meta device has none of them; its hooks are not run; a value read from a meta tensor reads 1.
An optimizer whose step still cannot run on meta tensors gives None: its state is then learnt at its
first real step, in memory, and the budget is estimated until then.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepnvme.offload.train.records import Entry, check_values, entries_of
from deepnvme.offload.train.wrapped import unhooked


class _ValuesAreOne(TorchDispatchMode):
    """Reading a meta tensor's value (`.item()`: a norm for a step size, a scalar counter) gives 1: a probe
    needs the state's layout, which no value changes, and meta tensors have no values."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


# Group settings that pick a kernel for the same state; the meta device has only the plain loop.
_KERNEL_CHOICES = {"foreach": False, "fused": False, "capturable": False, "differentiable": False}


#: What a probe learnt: the swapped tensors of the state, and whether any state (small values too) is made.
Probed = tuple[list[Entry], bool]


def probe(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor,
          dtype: torch.dtype) -> Probed | None:
    """The entries of the state `optimizer` makes at its first step of a parameter shaped like `p`, stepped
    in `dtype` (the master's when there is one) with `group`'s settings, and whether it makes any state;
    None when that cannot be learnt."""
    target = torch.empty_strided(p.shape, p.stride(), dtype=dtype, device="meta")  # state made like it
    target.grad = torch.empty_like(target)
    settings = {k: v for k, v in group.items() if k != "params"}
    settings.update({k: v for k, v in _KERNEL_CHOICES.items() if k in settings})
    step = unhooked(optimizer)  # torch's wrapper runs the step hooks: not for a probe
    live_groups, live_state = optimizer.param_groups, optimizer.state
    optimizer.param_groups = [{**settings, "params": [target]}]
    optimizer.state = defaultdict(dict)
    try:
        with warnings.catch_warnings(), torch.no_grad(), torch.device("meta"), _ValuesAreOne():
            warnings.simplefilter("ignore")
            step(optimizer)
        made = dict(optimizer.state.get(target, {}))
    except Exception:  # noqa: BLE001 - any failure means only that the probe cannot tell
        return None
    finally:
        optimizer.param_groups, optimizer.state = live_groups, live_state
    check_values(type(optimizer).__name__, f"a parameter {tuple(p.shape)}", made)  # refused before it is made
    return entries_of(made), bool(made)


class Prober:
    """probe(), once per (group settings, shape, dtype): a model's many parameters of a few shapes cost a
    few."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._seen: dict[tuple[Any, tuple[int, ...], torch.dtype], Probed | None] = {}

    def __call__(self, gi: int, p: torch.Tensor, dtype: torch.dtype) -> Probed | None:
        group = self.optimizer.param_groups[gi]
        # The group's settings, not its index: a setting changed (amsgrad on) makes other state.
        settings = tuple(sorted((str(k), repr(v)) for k, v in group.items() if k != "params"))
        key = (settings, tuple(p.shape), dtype)
        if key not in self._seen:
            self._seen[key] = probe(self.optimizer, self.optimizer.param_groups[gi], p, dtype)
        return self._seen[key]
