"""The offloaded optimizer's checks of a step's work before anything moves (a mixin of it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepnvme.offload.train.lending import owner_of

if TYPE_CHECKING:
    from deepnvme.offload.train.optimizer import OffloadedOptimizer

    _Base = OffloadedOptimizer
else:
    _Base = object


class Checks(_Base):
    """_check_work, _check_chunked and _check_owners_open of OffloadedOptimizer."""

    def _check_owners_open(self) -> None:
        """Refuse a step over stand-ins whose offload_parameters was closed since (their parameters are back
        in the model as other tensors: the step would skip them, silently)."""
        for p in (p for g in self.param_groups for p in g["params"]):
            owner = owner_of(p)
            if owner is not None and owner._closed:
                raise RuntimeError(f"{self._name(p)} was offloaded by offload_parameters, which was closed "
                                   "since: its parameters are other tensors now. Make a new optimizer on "
                                   "model.parameters() and load this one's state_dict() into it")

    def _check_work(self, p: torch.Tensor) -> None:
        """Refuse, before anything moves, a parameter this step cannot update."""
        self._check_param(p, self._name(p))
        if p.grad.is_sparse:
            raise RuntimeError(f"{self._name(p)} has a sparse gradient: OffloadedOptimizer does not take "
                               "sparse gradients (use a dense gradient, or an in-memory optimizer)")
        if p.grad.device != p.device:
            raise ValueError(f"{self._name(p)} is on {p.device} and its gradient on {p.grad.device}")
        rec = self._records.get(p)
        if rec is not None and (p.shape != rec.shape or p.dtype != rec.dtype):
            raise ValueError(f"{self._name(p)} changed from {tuple(rec.shape)} {rec.dtype} to "
                             f"{tuple(p.shape)} {p.dtype} since its state was made: the offloaded state "
                             "cannot follow; make a new optimizer (or load a checkpoint made for it)")
        if rec is not None and rec.chunk and not p.is_contiguous():
            raise ValueError(f"{self._name(p)} is stepped in chunks of its elements and is no longer "
                             "contiguous: make it contiguous again (or a new optimizer)")

    def _check_chunked(self, gi: int, p: torch.Tensor) -> None:
        """A parameter stepped in chunks cannot have its state laid out anew mid-step: when its group's
        settings now make another state (amsgrad turned on, say), refuse before anything moves."""
        rec = self._records[p]
        known = self._entries(gi, p) if rec.chunk else None
        if known is None:
            return
        now, was = [(e.key, e.dtype) for e in known[0]], [(e.key, e.dtype) for e in rec.entries]
        if now != was:
            raise ValueError(f"the state of {self._name(p)} is stepped in chunks as {was}, and its group's "
                             f"settings now make {now}: it cannot be laid out anew in chunks; save(), make a "
                             "new optimizer with these settings and load() (or restore the settings)")
