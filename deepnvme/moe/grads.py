"""Gradient reduction for data + expert parallel training: what DeepSpeed's engine does after backward.

Call :func:`allreduce_moe_gradients` after ``loss.backward()`` and before ``optimizer.step()`` (do not wrap
the model in DistributedDataParallel, which would also average expert gradients over the whole world):

* non-expert gradients are averaged over the data-parallel group (all ranks by default);
* expert gradients are summed over their expert-data-parallel group (the ranks holding the same experts) and
  divided by the data-parallel world size, not the EDP size: the all-to-all backward has already summed the
  contributions of the ep ranks that sent tokens to an expert, so this makes expert gradients equal to those
  of the same model trained in one process on all ranks' batches with the mean of the ranks' losses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepnvme.moe.groups import edp_group_of
from deepnvme.moe.utils import is_moe_param


def _allreduce_scaled(grads: list[torch.Tensor], group: Any, scale: float) -> None:
    """Sum ``grads`` over ``group`` in one flat buffer per dtype/device, multiply by ``scale``, write back."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.mul_(scale)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


def allreduce_moe_gradients(model: nn.Module, dp_group: Any = None, include_dense: bool = True) -> None:
    """Reduce the gradients of ``model`` across ranks (see the module docstring); no-op without
    torch.distributed.

    Parameters without a gradient get a zero one first, so every rank reduces the same buffers (a parameter
    that is unused on one rank must not make the ranks' collectives differ). ``dp_group`` is the data-parallel
    group of the non-expert parameters (default: the world); ``include_dense=False`` reduces only expert
    gradients, for callers that reduce the rest themselves.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dp_size = dist.get_world_size(dp_group)
    dense: list[torch.Tensor] = []
    experts: dict[str, list[torch.Tensor]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if is_moe_param(p):
            experts.setdefault(p.group_name, []).append(p.grad)
        elif include_dense:
            dense.append(p.grad)
    if dense:
        _allreduce_scaled(dense, dp_group, 1.0 / dp_size)
    for name in sorted(experts):
        _allreduce_scaled(experts[name], edp_group_of(name), 1.0 / dp_size)
