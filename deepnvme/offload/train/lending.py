"""The offloaded optimizer's step over parameters kept on the drive by offload_parameters: each tile's
parameters and gradients are read (ahead, in the order of the tiles) beside the tile's state, stepped in
memory, and the parameters written back once their last piece is stepped; gradients stay on the drive
(they are the step's input, unchanged) until zero_grad()."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepnvme.offload.swap import Lease, ReadAhead
from deepnvme.offload.train.held import (
    BUSY_WAIT_S,
    GRAD_APPLIED,
    GRAD_ON_DRIVE,
    GRAD_ZERO,
    NO_GRAD,
    OWNER_ATTR,
    Held,
)
from deepnvme.offload.train.params import OffloadedParameters


def owner_of(p: torch.Tensor) -> OffloadedParameters | None:
    """The OffloadedParameters a stand-in belongs to (None for a parameter in memory)."""
    return getattr(p, OWNER_ATTR, None)


def applied_in_backward(p: torch.Tensor) -> bool:
    """Whether `p`'s gradient was applied by the step in its unit's backward (nothing left to step)."""
    return owner_of(p) is not None and held_of(p).grad_state() == GRAD_APPLIED


def held_of(p: torch.Tensor) -> Held:
    return owner_of(p).held_by_stand[id(p)]  # type: ignore[union-attr]


class Lending:
    """The offloaded parameters of a step's tiles (lists of stand-ins, a stand-in in each tile it has a
    piece in): take(i) gives each its data and gradient in memory, give_back(i) writes those whose last
    piece was in tile i."""

    def __init__(self, tiles: Sequence[Sequence[torch.Tensor]]) -> None:
        self.first: list[list[Held]] = []
        self.last: dict[int, list[Held]] = {}
        seen: dict[int, Held] = {}
        last: dict[int, int] = {}
        owners: set[int] = set()
        self.owner: OffloadedParameters | None = None
        for i, tile in enumerate(tiles):
            self.first.append([])
            for p in tile:
                owner = owner_of(p)
                if owner is None:
                    continue
                if id(p) not in seen:
                    seen[id(p)] = held_of(p)
                    self.first[-1].append(seen[id(p)])
                owners.add(id(owner))
                self.owner = owner
                last[id(p)] = i
        for key, i in last.items():
            self.last.setdefault(i, []).append(seen[key])
        if len(owners) > 1:
            raise ValueError("an OffloadedOptimizer steps the parameters of one offload_parameters at most: "
                             "these come from several models (make an optimizer per model)")
        self.reader: ReadAhead | None = None
        self._locked = False
        if self.owner is not None:
            owner = self.owner
            owner.lock.acquire()  # held to done()/close(): a forward in another thread waits for the step
            self._locked = True
            try:
                self._start(owner)
            except BaseException:
                self.done()
                raise

    def _start(self, owner: OffloadedParameters) -> None:
        """Checks before anything moves, then the reads of the tiles' parameters and gradients."""
        owner._check_open()
        owner.settle_interrupted()
        owner.space.check_files()  # a swap file deleted or cut short: an error naming it, before updates
        # Forwards running in other threads (an evaluation beside training) end first; a unit that stays
        # in use is this thread's own forward or backward, in which a step cannot run.
        if not owner.idle.wait_for(lambda: not any(u.present or u.held for u in owner.units), BUSY_WAIT_S):
            raise RuntimeError("step() while a forward or backward of the offloaded model is in "
                               f"progress (still after {BUSY_WAIT_S:g} s): step after backward() returns")
        owner._drop_pending()
        groups = [[x for h in hs for x in ([h.data] + ([h.grad_unit] if _on_drive(h) else []))]
                  for hs in self.first]
        owner._settle_writes(x for g in groups for x in g)
        self.reader = ReadAhead(owner.space, groups)

    def take(self, i: int) -> dict[torch.Tensor, torch.Tensor]:
        """The tensors to step in place of tile i's offloaded stand-ins (filled, with their gradients)."""
        if self.reader is None:
            return {}
        lease: Lease | None = self.reader.take(i)
        if lease is not None:
            self.owner.counts["unit_reads"] += 1  # type: ignore[union-attr]
            self.owner.counts["bytes_read"] += sum(x.nbytes for x in lease.units)  # type: ignore[union-attr]
        try:
            for h in self.first[i]:
                h.fill(lease.view(h.data))  # type: ignore[union-attr]
                h.real.grad = h.gradient(lease)
        finally:
            if lease is not None:
                lease.release()
        return {h.stand: h.real for hs in self.first[:i + 1] for h in hs}

    def give_back(self, i: int) -> None:
        """Write the parameters whose last piece was in tile i, and free them."""
        done = self.last.get(i, [])
        if not done or self.owner is None:
            return
        # Reads issued ahead may fill the pool: dropped (and issued again) when the write needs the room.
        self.owner._write(done, [h.real.detach() for h in done], [h.data for h in done],
                          make_room=lambda: self.reader.restart(i + 1))  # type: ignore[union-attr]
        for h in done:
            h.park_grad()
            h.empty()

    def done(self) -> None:
        """The step is over: forwards in other threads may go on."""
        if self._locked:
            self._locked = False
            self.owner.lock.release()  # type: ignore[union-attr]

    def close(self) -> None:
        """After an error: free what was filled (parameters on the drive are as they were written)."""
        if self.reader is not None:
            self.reader.close()
        for hs in self.first:
            for h in hs:
                h.park_grad()
                h.empty()
        self.done()


def _on_drive(h: Held) -> bool:
    return h.grad_unit is not None and h.grad_state() == GRAD_ON_DRIVE


def zero_offloaded_grads(params: Sequence[torch.Tensor], set_to_none: bool) -> list[tuple[torch.Tensor, Any]]:
    """zero_grad() of the offloaded stand-ins among `params` (nothing read or written: a gradient set to
    zero is made as zeros when next wanted); returns the stand-ins whose .grad was taken off for the
    wrapped optimizer's own zero_grad, with what to put back."""
    out = []
    for owner in {id(o): o for o in map(owner_of, params) if o is not None}.values():
        owner.settle_interrupted()
    for p in params:
        if owner_of(p) is None or p.grad is None:
            continue
        h = held_of(p)
        if set_to_none:
            h.grad, h.stand.grad = NO_GRAD, None
        else:
            if h.grad_state() is not h.marker and isinstance(h.grad_state(), torch.Tensor):
                continue  # a tensor the caller set: torch zeroes it
            h.grad, h.stand.grad = GRAD_ZERO, None
            out.append((p, h.marker))
    return out


class Present:
    """The lending of a step in the backward: the unit's parameters are in memory already, with their
    gradients; the owner writes them back after the step."""

    def __init__(self, lent: dict[torch.Tensor, torch.Tensor]) -> None:
        self.lent = lent

    def take(self, i: int) -> dict[torch.Tensor, torch.Tensor]:
        return self.lent

    def give_back(self, i: int) -> None:
        pass

    def done(self) -> None:
        pass

    def close(self) -> None:
        pass
