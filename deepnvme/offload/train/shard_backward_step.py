"""The optimizer step in the backward for FSDP2's shards offloaded by offload_shards
(`OffloadedOptimizer(step_in_backward=True)`): a unit's shards are stepped as soon as FSDP has reduced its
gradients, while its parameter shards and their gradients are in memory, and its optimizer state was read
during its backward. The gradients are then dropped (set to None: they never reach the drive) and the
shards written once, stepped. Per step this saves, for each trainable unit, the gradients' write and the
step's read of shards and gradients; and the step's drive traffic, which after the backward cannot hide
behind any compute, overlaps the backward of the units before it.

The arithmetic is that of the step after the backward for an element-wise optimizer (each element updated
from its own gradient and state), the only kind it takes; step() afterwards steps what has a gradient
still (nothing, after a complete backward). A unit is stepped in every backward that completes it while
the flag is on: for the micro-batches of a gradient accumulation before the last, turn it off; a second
backward reaching a unit stepped since the last step() is refused (its gradient, applied, is gone). The
gradients being gone, clipping by their global norm is not possible: step after the backward for that.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from deepnvme.offload.train.lending import Present

if TYPE_CHECKING:
    from deepnvme.offload.train.optimizer import OffloadedOptimizer
    from deepnvme.offload.train.shard_units import ShardUnit
    from deepnvme.offload.train.shards import OffloadedShards


class ShardStepper:
    """What an OffloadedShards calls as a unit's backward begins (`prefetch`) and completes (`step`)."""

    def __init__(self, opt: OffloadedOptimizer, owner: OffloadedShards) -> None:
        self.owner = owner
        self._opt = weakref.ref(opt)  # the optimizer owns its stepper; the shards only point at it
        owner.stepper = self
        self.on = True
        self.profiles: list[Any] = []  # the steps made in backwards since the last step()
        self.ahead: tuple[list[int], list[Any], Any] | None = None  # a unit's state read ahead
        self.stepped: set[int] = set()  # indices of the units stepped since the last step()

    @property
    def opt(self) -> OffloadedOptimizer:
        opt = self._opt()
        if opt is None:
            raise RuntimeError("the OffloadedOptimizer stepping in backward was collected")
        return opt

    def _work(self, u: ShardUnit, ready: Any) -> list[tuple[int, torch.Tensor]]:
        """The (group, view) pairs of `u`'s parameters that `ready(DTensor)` accepts, in the groups' order."""
        mine = {id(p) for p in u.params}
        views = self.opt._views
        return [(gi, v) for gi, g in enumerate(self.opt.param_groups) for v in g["params"]
                if id(d := views.dtensor_of.get(id(v))) in mine and ready(d)]

    def check(self, u: ShardUnit) -> None:
        """A backward reaches `u`: refused if `u` was stepped in an earlier one since step() (alike on every
        rank: not a failure the ranks need to agree on)."""
        if u.index in self.stepped:
            raise RuntimeError(f"{u.name} was stepped by the optimizer in an earlier backward and its "
                               "gradients are gone, so this backward cannot add to them: call opt.step() "
                               "(and opt.zero_grad()) before it, or set opt.step_in_backward = False for the "
                               "micro-batches before the last of an accumulation")

    def prefetch(self, u: ShardUnit) -> None:
        """`u`'s backward begins: the state of its parameters that will have gradients is read now."""
        self.drop_prefetch()
        opt = self.opt
        if not self.on or opt._closed or opt._broken is not None:
            return
        work = self._work(u, lambda d: d.requires_grad)
        if work:
            tiles = opt._make_records(work)
            reader = opt._reader(tiles)
            reader.pump()
            self.ahead = ([id(v) for _, v in work], tiles, reader)

    def drop_prefetch(self) -> None:
        if self.ahead is not None:
            self.ahead[2].close()
            self.ahead = None

    @torch.no_grad()
    def step(self, u: ShardUnit) -> bool:
        """Step `u`'s shards that have gradients (complete: FSDP reduced them) and drop those gradients;
        whether any was stepped."""
        ahead, self.ahead = self.ahead, None
        try:
            if not self.on:
                return False
            opt = self.opt
            opt._check_usable()
            opt._views.sync(u.params)
            work = self._work(u, lambda d: d.grad is not None)
            if not work:
                return False
            for _, v in work:
                opt._check_work(v)
            reader = None
            if ahead is not None and ahead[0] == [id(v) for _, v in work]:
                (_, tiles, reader), ahead = ahead, None  # the step takes the read (and closes it)
            else:
                tiles = opt._make_records(work)
            self.profiles.append(opt._run_tiles(work, tiles, Present({}), reader))
        finally:
            if ahead is not None:  # not taken: its pool memory back
                ahead[2].close()
        opt._outline([v for _, v in work if v in opt._records])
        for _, v in work:
            opt._views.dtensor_of[id(v)].grad = None
            v.grad = None
        self.stepped.add(u.index)
        return True

    def step_began(self) -> None:
        """The optimizer's step() begins: backwards from now are those of the next step."""
        self.reset()

    def reset(self) -> None:
        """The optimizer's state was loaded (or a step begins): nothing is stepped yet."""
        self.drop_prefetch()
        self.stepped.clear()

    def failed(self) -> None:
        """A backward failed on some rank (its hooks raised on every rank): units stepped before it on one
        rank may not be on another, so the optimizer refuses to step until a load (its steps in backwards
        too: what was stepped is forgotten, alike on every rank)."""
        self.drop_prefetch()
        self.stepped.clear()
        if self.on:
            self.opt.refuse_steps("a backward whose units the optimizer steps failed part way, so the ranks' "
                                  "shards and optimizer state may differ; load a checkpoint (dcp_load)")

    def close(self) -> None:
        self.drop_prefetch()
        if self.owner.stepper is self:
            self.owner.stepper = None


__all__ = ["ShardStepper"]
