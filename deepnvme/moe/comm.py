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


class _AllToAllRows(torch.autograd.Function):
    """Rows ``send[j]`` at a time go to group rank j; ``recv[j]`` rows arrive from rank j, in rank order."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor, send: list[int], recv: list[int]) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.send, ctx.recv = group, send, recv
        output = input.new_empty((sum(recv), *input.shape[1:]))
        dist.all_to_all_single(output, input.contiguous(), recv, send, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return None, _AllToAllRows.apply(ctx.group, grad_output, ctx.recv, ctx.send), None, None


def all_to_all_rows(input: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    """Exchange uneven dim-0 chunks across ``group``: ``send[j]`` rows of ``input`` (in order) to rank j,
    ``recv[j]`` rows from rank j (as :func:`exchange_counts` tells). Differentiable; the backward sends the
    gradient back the same way."""
    world = dist.get_world_size(group) if group is not None else 1
    if len(send) != world or len(recv) != world or sum(send) != input.shape[0]:
        raise ValueError(f"send/recv must give {world} row counts each, send summing to {input.shape[0]}; "
                         f"got send={send}, recv={recv}")
    if world == 1:
        return input
    return _AllToAllRows.apply(group, input, list(send), list(recv))


def exchange_counts(counts: Tensor, group: Any) -> Tensor:
    """``counts`` [ep, n] (row j: what this rank sends to rank j) -> [ep, n] (row j: what rank j sends to
    this rank), one small all-to-all."""
    if group is None or dist.get_world_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_to_all(input: Tensor, group: Any) -> Tensor:
    """Exchange equal dim-0 chunks of ``input`` across ``group`` (identity when the group has one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return input
    if input.shape[0] % dist.get_world_size(group):
        raise ValueError(
            f"input dim 0 ({input.shape[0]}) must split evenly over {dist.get_world_size(group)} ranks"
        )
    return _AllToAll.apply(group, input)
