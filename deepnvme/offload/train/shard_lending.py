"""The offloaded optimizer's step over FSDP2 shards kept on the drive by offload_shards: each unit's
parameter shards and gradients are brought (read ahead in the order of the tiles) when its first piece is
stepped, and its parameters written once its last piece is (its gradients given back unchanged)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepnvme.offload.train.dtensors import ShardViews
from deepnvme.offload.train.shard_units import ShardUnit, unit_of
from deepnvme.offload.train.shards import OffloadedShards


class ShardLending:
    """Lending (lending.py) for the views of offloaded shards: take(i), give_back(i), done(), close()."""

    def __init__(self, owner: OffloadedShards, tiles: Sequence[Sequence[ShardUnit]]) -> None:
        self.owner = owner
        self.first: list[list[ShardUnit]] = []
        self.last: dict[int, list[ShardUnit]] = {}
        last: dict[int, tuple[int, ShardUnit]] = {}
        for i, tile in enumerate(tiles):
            self.first.append([])
            for u in tile:
                if id(u) not in last:
                    self.first[-1].append(u)
                last[id(u)] = (i, u)
        for i, u in last.values():
            self.last.setdefault(i, []).append(u)
        owner._check_open()
        owner.space.check_files()  # a swap file deleted or cut short: an error naming it, before updates

    def take(self, i: int) -> dict[torch.Tensor, torch.Tensor]:
        self.owner._drain(block=False)  # units written since give their memory back as the walk goes
        for u in self.first[i]:
            self.owner._bring(u, grads=True)
        ahead = [u for tile in self.first[i + 1:] for u in tile][:1 + self.owner.prefetch]
        self.owner._read_ahead(ahead, grads=True)
        return {}  # the views are the shards' own tensors: stepped where they are

    def give_back(self, i: int) -> None:
        for u in self.last.get(i, []):
            self.owner.release_stepped(u)

    def done(self) -> None:
        self.owner.settle()

    def close(self) -> None:
        try:
            self.owner.settle()
        except OSError:
            pass  # the step's own error is the one raised


def shard_lending(tiles: Sequence[Sequence[torch.Tensor]], views: ShardViews) -> ShardLending | None:
    """The lending of a step whose tiles hold views of offloaded shards (None when none does)."""
    owners: dict[int, OffloadedShards] = {}
    units: list[list[ShardUnit]] = []
    for tile in tiles:
        units.append([])
        for v in tile:
            p = views.dtensor_of.get(id(v))
            u = None if p is None else unit_of(p)
            if u is not None:
                units[-1].append(u)
                owners[id(u.owner)] = u.owner
    if not owners:
        return None
    if len(owners) > 1:
        raise ValueError("an OffloadedOptimizer steps the shards of one offload_shards at most: these come "
                         "from several models (make an optimizer per model)")
    return ShardLending(next(iter(owners.values())), units)


def by_unit(work: list[tuple[int, torch.Tensor]], views: ShardViews) -> list[tuple[int, torch.Tensor]]:
    """`work` (group, parameter) with the views of offloaded shards in the order of their units, so that a
    unit is brought once and given back as soon as its last parameter is stepped (in the groups' order, a
    unit with parameters in two groups, decayed and not, would stay in memory from the first group's walk
    to the second's). Only for an element-wise optimizer, where the order of parameters changes nothing."""
    def key(item: tuple[int, int, torch.Tensor]) -> tuple[int, int]:
        at, _, p = item
        d = views.dtensor_of.get(id(p))
        u = None if d is None else unit_of(d)
        return (-1 if u is None else u.index, at)

    return [(gi, p) for _, gi, p in sorted(((at, gi, p) for at, (gi, p) in enumerate(work)), key=key)]
