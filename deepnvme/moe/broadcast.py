"""Make replicas start equal: what DeepSpeed's engine does to the model at ``deepspeed.initialize``.

Ranks seeded alike already build equal models (expert initialisation derives from the global RNG state and
the global expert id only). When they are not, call :func:`broadcast_moe_parameters` once after building the
model: non-expert parameters and buffers come from the first rank of the data-parallel group, expert
parameters from the first rank of their expert-data-parallel group (the ranks holding the same experts).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from deepnvme.moe.groups import edp_group_of
from deepnvme.moe.utils import is_moe_param


def _first_rank(group: Any) -> int:
    """Global rank of the group's first member (the world's rank 0 for the default group)."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


def broadcast_moe_parameters(model: nn.Module, dp_group: Any = None) -> None:
    """Copy parameters (and buffers) from each group's first rank to the others; no-op without distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for p in model.parameters():
        if is_moe_param(p):
            group = edp_group_of(p.group_name)
        else:
            group = dp_group
        dist.broadcast(p.data, src=_first_rank(group), group=group)
    for b in model.buffers():
        dist.broadcast(b, src=_first_rank(dp_group), group=dp_group)
