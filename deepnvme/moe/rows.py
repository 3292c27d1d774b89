"""Expert rows: a batch's kept routes laid out as one row per route, grouped by expert with nothing between
the groups, instead of an ``[E, C, M]`` buffer padded to the capacity.

The grouped experts and the dropless mode compute on this layout: ``counts[e]`` rows of expert e, expert
after expert. A route's row is ``start[e] + slot``, so the routing op's dispatch and combine serve unchanged,
seen as one expert with ``T = sum(counts)`` slots. With expert parallelism the groups of each destination
rank are contiguous (global experts are numbered rank-major), which is what a variable all-to-all sends;
:class:`Regroup` reorders what arrives from (source rank, local expert) to (local expert, source rank) order
and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ExpertRows:
    """Where each route's row lies: ``index`` (all zeros) and ``slot`` (-1 for dropped routes) as the
    routing op's one-expert dispatch and combine take them; ``counts`` rows per expert; ``total`` their
    sum."""

    index: Tensor
    slot: Tensor
    counts: list[int]
    total: int


def expert_rows(expert_idx: Tensor, slot: Tensor, num_experts: int) -> ExpertRows:
    """Lay out the kept routes (``slot >= 0``) one row each, expert after expert.

    Expert e gets ``max(slot) + 1`` rows over its kept routes (its count when slots are dense from 0, as the
    gate assigns them; a gap would be a row nobody reads). One host sync: the counts.
    """
    kept = slot >= 0
    experts = expert_idx[kept].long()
    rows = torch.zeros(num_experts, dtype=torch.long, device=slot.device)
    if experts.numel():
        rows = rows.scatter_reduce(0, experts, slot[kept].long() + 1, reduce="amax")
    starts = rows.cumsum(0) - rows
    flat = torch.where(kept, starts[expert_idx.long().clamp(0, num_experts - 1)] + slot, -1)
    counts = rows.tolist()
    return ExpertRows(torch.zeros_like(expert_idx), flat, counts, sum(counts))


class Regroup:
    """Rows received from ``ep`` ranks, in (source rank, local expert) blocks of ``recv_counts[r][j]`` rows,
    reordered to (local expert, source rank) blocks, so each local expert's rows are contiguous
    (:meth:`to_experts`), and back (:meth:`to_ranks`). Both are differentiable gathers."""

    def __init__(self, recv_counts: Tensor) -> None:
        ep, local = recv_counts.shape
        sizes_rj = recv_counts.reshape(-1)
        starts_rj = (sizes_rj.cumsum(0) - sizes_rj).reshape(ep, local)
        sizes_jr = recv_counts.t().reshape(-1)
        starts_jr = sizes_jr.cumsum(0) - sizes_jr
        total = int(sizes_rj.sum())
        # Row p of the expert-major layout is row perm[p] of the rank-major one.
        shift = starts_rj.t().reshape(-1) - starts_jr
        self.perm = torch.repeat_interleave(shift, sizes_jr, output_size=total) + torch.arange(
            total, device=recv_counts.device)
        self.inverse = torch.empty_like(self.perm)
        self.inverse[self.perm] = torch.arange(total, device=recv_counts.device)
        self.counts = recv_counts.sum(0).tolist()

    def to_experts(self, rows: Tensor) -> Tensor:
        """Rank-major rows -> expert-major rows."""
        return rows.index_select(0, self.perm)

    def to_ranks(self, rows: Tensor) -> Tensor:
        """Expert-major rows -> rank-major rows."""
        return rows.index_select(0, self.inverse)


__all__ = ["ExpertRows", "Regroup", "expert_rows"]
