"""All-to-all over the expert-parallel group, differentiable.

gloo implements ``all_to_all_single`` on CPU tensors (equal and uneven splits; checked with torch 2.13), NCCL
on CUDA tensors, so one code path serves both. The exchange with equal splits is its own inverse, which makes
the backward the same exchange applied to the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to group rank j; the received chunks are stacked in source-rank order."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        return None, _AllToAll.apply(ctx.group, grad_output)


def all_to_all(input: Tensor, group: Any) -> Tensor:
    """Exchange equal dim-0 chunks of ``input`` across ``group`` (identity when the group has one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return input
    if input.shape[0] % dist.get_world_size(group):
        raise ValueError(
            f"input dim 0 ({input.shape[0]}) must split evenly over {dist.get_world_size(group)} ranks"
        )
    return _AllToAll.apply(group, input)
