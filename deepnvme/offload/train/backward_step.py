"""The optimizer step in the backward (offload_parameters with `OffloadedOptimizer(step_in_backward=True)`):
a unit is stepped as soon as its backward is complete, while its parameters and gradients are in memory, so
its gradients never reach the drive and the step reads only the optimizer's state. Per step this saves,
for each trainable unit, the gradients' write and the step's read of parameters and gradients: of the six
transfers of the unit's bytes a step makes otherwise, three remain (the forward's read, the backward's read,
the parameters' write), beside the state's read and write.

It is the same arithmetic as a step after the backward for an element-wise optimizer (each element updated
from its own gradient and state: torch's Adam, AdamW, SGD, ...), which is the only kind it takes. A unit is
stepped only when the backward that completes it is the last one its gradients wait for: a unit run
several times before a backward (two forwards, one loss), a backward interrupted (Ctrl-C), a forward of it
running in another thread, or micro-batches before the last of an accumulation (the caller turns the flag
off for those) leave its gradients on the drive, and step() steps it as usual.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from deepnvme.offload.train.held import Held
from deepnvme.offload.train.lending import Present, owner_of
from deepnvme.offload.train.shard_backward_step import ShardStepper
from deepnvme.offload.train.shard_units import unit_of

if TYPE_CHECKING:
    from deepnvme.offload.train.optimizer import OffloadedOptimizer


def check_can_step(optimizer: torch.optim.Optimizer, elementwise: bool,
                   params: list[torch.Tensor] | None = None) -> Any:
    """The OffloadedParameters (or, for FSDP2's shards, the OffloadedShards) whose units `optimizer` would
    step in their backward (its parameters, or `params` where its groups hold views of DTensors now);
    TypeError or ValueError, before anything changes, when it cannot."""
    if not elementwise:
        raise TypeError("step_in_backward=True needs an element-wise optimizer (each element updated "
                        f"from its own gradient and state); {type(optimizer).__name__} is not one (or "
                        "declare it with elementwise=True): step it after the backward")
    if params is None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
    shards = {id(u.owner): u.owner for p in params if (u := unit_of(p)) is not None}
    owners = shards or {id(o): o for p in params if (o := owner_of(p)) is not None}
    how = "offload_shards" if shards else "offload_parameters (made on model.parameters() after it)"
    if len(owners) != 1:
        raise ValueError(f"step_in_backward=True needs the parameters of one model offloaded by {how}; these "
                         f"have {len(owners)} such models")
    owner = next(iter(owners.values()))
    if owner.stepper is not None:
        raise ValueError("another OffloadedOptimizer steps this model in its backward already (close it "
                         "first)")
    return owner


class BackwardStepper:
    """What an OffloadedParameters calls as a unit's backward completes (`step(helds)`), for one optimizer."""

    def __init__(self, opt: OffloadedOptimizer) -> None:
        self.owner = check_can_step(opt.optimizer, opt.elementwise)
        self._opt = weakref.ref(opt)  # the optimizer owns its stepper; the model only points at it, weakly
        self.owner.stepper = self
        self.on = True
        self.profiles: list[Any] = []  # the steps made in backwards since the last step()
        self.ahead: tuple[list[int], list[Any], Any] | None = None  # a unit's state read ahead

    @property
    def opt(self) -> OffloadedOptimizer:
        opt = self._opt()
        if opt is None:  # collected: it can step nothing
            raise RuntimeError("the OffloadedOptimizer stepping in backward was collected")
        return opt

    def _work(self, helds: list[Held], wanted: Any) -> list[tuple[int, torch.Tensor]]:
        by_stand = {id(h.stand): h for h in helds if wanted(h)}
        return [(gi, p) for gi, g in enumerate(self.opt.param_groups) for p in g["params"]
                if id(p) in by_stand]

    def prefetch(self, helds: list[Held]) -> None:
        """A unit's backward begins: the state of its parameters that will have gradients is read now,
        while the backward computes, for step() to find it in memory."""
        self.drop_prefetch()
        if not self.on or self.opt._closed or self.opt._broken is not None:
            return
        work = self._work(helds, lambda h: h.stand.requires_grad)
        if work:
            tiles = self.opt._make_records(work)
            reader = self.opt._reader(tiles)
            reader.pump()
            self.ahead = ([id(p) for _, p in work], tiles, reader)

    def drop_prefetch(self) -> None:
        if self.ahead is not None:
            self.ahead[2].close()
            self.ahead = None

    def step(self, helds: list[Held]) -> list[Held]:
        """Step those of `helds` (a unit's parameters, their values and gradients in memory) that are in
        the optimizer's groups; the ones stepped, their new values in place."""
        ahead, self.ahead = self.ahead, None
        try:
            if not self.on:
                return []
            opt = self.opt
            by_stand = {id(h.stand): h for h in helds}
            work = self._work(helds, lambda h: True)
            if not work:
                return []
            opt._check_usable()  # sparse gradients never come here: the unit's finish refused them
            reader = None
            if ahead is not None and ahead[0] == [id(p) for _, p in work]:
                (_, tiles, reader), ahead = ahead, None  # the step takes the read (and closes it)
            else:
                tiles = opt._make_records(work)
            lent = Present({p: by_stand[id(p)].real for _, p in work})
            self.profiles.append(opt._run_tiles(work, tiles, lent, reader))
        finally:
            if ahead is not None:  # not taken: its pool memory back
                ahead[2].close()
        opt._outline([p for _, p in work if p in opt._records])
        return [by_stand[id(p)] for _, p in work]

    def reset(self) -> None:
        """The optimizer's state was loaded: a read ahead is stale."""
        self.drop_prefetch()

    def step_began(self) -> None:
        """The optimizer's step() begins: forwards from now are those of the next step."""
        self.drop_prefetch()
        for u in self.owner.units:
            u.graphs = 0

    def close(self) -> None:
        self.drop_prefetch()
        if self.owner.stepper is self:
            self.owner.stepper = None


def merge(into: Any, profiles: list[Any]) -> None:
    """Add the transfers and updates of steps made in backwards to step()'s profile."""
    for prof in profiles:
        into.reads += prof.reads
        into.writes += prof.writes
        into.updates += prof.updates
        into.read_wait_s += prof.read_wait_s



def _stepper_of(opt: OffloadedOptimizer) -> Any:
    """The stepper in the backward of what `opt` steps: FSDP2's shards (shard_backward_step.py), or the
    units of offload_parameters."""
    dtensors = list(opt._views.dtensor_of.values())
    if any(unit_of(d) is not None for d in dtensors):
        return ShardStepper(opt, check_can_step(opt.optimizer, opt.elementwise, dtensors))
    return BackwardStepper(opt)


if TYPE_CHECKING:
    _Base = OffloadedOptimizer
else:
    _Base = object


class StepsInBackward(_Base):
    """`step_in_backward` of OffloadedOptimizer (a mixin of it)."""

    _stepper: BackwardStepper | None = None

    @property
    def step_in_backward(self) -> bool:
        """Whether offloaded units are stepped as their backward completes (see backward_step.py). Turn it
        off for the micro-batches of a gradient accumulation before the last, and on for the last."""
        return self._stepper is not None and self._stepper.on

    @step_in_backward.setter
    def step_in_backward(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"step_in_backward must be a bool, got {on!r}")
        if self._stepper is None and on:
            self._check_open()
            self._stepper = _stepper_of(self)
        if self._stepper is not None:
            self._stepper.on = on

    def _backward_steps_begin(self) -> None:
        """step() begins: what was stepped in backwards joins its profile; forwards from now on count for
        the next step."""
        if self._stepper is not None:
            self._stepper.step_began()

    def _backward_steps_reset(self) -> None:
        """The state was loaded: nothing stepped in a backward since, no read ahead."""
        if self._stepper is not None:
            self._stepper.reset()

    def _drop_backward_prefetch(self) -> None:
        """Give back the pool memory of a read issued for a unit's step in a backward that never reached it
        (the backward raised): the pool's other users would wait for it for ever."""
        if self._stepper is not None:
            self._stepper.drop_prefetch()

    def _backward_steps_into(self, profile: Any) -> None:
        if self._stepper is not None:
            merge(profile, self._stepper.profiles)
            self._stepper.profiles = []

    def _backward_steps_end(self) -> None:
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None
