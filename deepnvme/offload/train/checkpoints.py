"""The offloaded optimizer's state in and out whole: state_dict(), load_state_dict(), save(), load().

save() and load() stream: the state is never all in memory, only a piece at a time in the pool (a
parameter's state, or one tensor's chunk of it); state_dict() holds everything, as it must.
"""

from __future__ import annotations

import mmap
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from deepnvme.offload._doors import PAGE, madvise, save_streamed
from deepnvme.offload.swap import Lease, ReadAhead, Unit, round_up
from deepnvme.offload.train.dtensors import is_dtensor, local_state
from deepnvme.offload.train.records import (
    Entry,
    Record,
    entries_of,
    is_swapped,
    layout,
    strides_of,
    untouched,
)

if TYPE_CHECKING:
    from deepnvme.offload.train.optimizer import OffloadedOptimizer

    _Base = OffloadedOptimizer
else:
    _Base = object

_MASTER = "master"  # optimizer.MASTER (not imported: that module imports this one)


class Checkpoints(_Base):
    """state_dict / load_state_dict / save / load of OffloadedOptimizer (a mixin of it)."""

    def _placeholders(self) -> tuple[dict[torch.Tensor, dict[str, Any]], dict[int, tuple[Record, str]]]:
        """State dicts whose swapped tensors are untouched anonymous memory (no RSS), and their owners."""
        state: dict[torch.Tensor, dict[str, Any]] = {}
        owners: dict[int, tuple[Record, str]] = {}
        for p, rec in self._grouped():
            st = dict(rec.scalars)
            for e in rec.entries:
                t = untouched(e.shape, e.dtype)
                owners[t.untyped_storage().data_ptr()] = (rec, e.key)
                st[e.key] = t
            state[p] = st
        return state, owners

    def _grouped(self) -> list[tuple[torch.Tensor, Record]]:
        """The records of made state of parameters in a group (others' state is kept, but torch cannot pack
        it)."""
        live = self._in_groups()
        return [(p, rec) for p, rec in self._records.items() if rec.made and id(p) in live]

    def _packed(self, state: dict[torch.Tensor, dict[str, Any]]) -> dict[str, Any]:
        inner = self.optimizer
        inner.state = defaultdict(dict, {**state, **self._loose})
        try:
            return inner.state_dict()
        finally:
            inner.state = defaultdict(dict)

    def save(self, path: str | os.PathLike) -> None:
        """Write the whole optimizer state to `path` in torch's format (deepnvme.save: atomic, O_DIRECT).

        Streamed a piece at a time through the pool: the state is never all in memory. The file is what
        `state_dict()` would give: a plain optimizer's `load_state_dict(torch.load(path))` takes it (with
        master weights, each parameter's state also holds its fp32 master under "master").
        """
        self._check_usable()
        self._prune()
        self.swap.check_files()
        state, owners = self._placeholders()
        # What torch asks for, in its order: a whole record's tensors from one read of its unit; a chunked
        # record's tensors one after another, each a chunk at a time.
        groups: list[list[Unit]] = []
        first: dict[tuple[int, str], int] = {}
        for _, rec in self._grouped():
            if not rec.chunk:
                first.update({(id(rec), e.key): len(groups) for e in rec.entries})
                groups.append(rec.units[0])
                continue
            for i, e in enumerate(rec.entries):
                first[(id(rec), e.key)] = len(groups)
                groups += [[units[i]] for units in rec.units]
        reader = ReadAhead(self.swap, groups)
        held: list[Any] = [-1, None]  # the group whose lease is held, the lease

        def lease_at(g: int) -> Lease:
            if held[0] != g:
                if held[1] is not None:
                    held[1].release()
                    held[1] = None
                if g < held[0]:
                    raise RuntimeError("torch.save asked for the state out of order")
                while held[0] < g:  # groups torch never asked for (none are expected) are skipped
                    held[0] += 1
                    lease = reader.take(held[0])
                    if held[0] < g and lease is not None:
                        lease.release()
                    else:
                        held[1] = lease
            return held[1]

        def chunks(rec: Record, g: int, i: int) -> Iterator[torch.Tensor]:
            for k in range(rec.pieces):
                lo, hi = rec.span(k)
                yield lease_at(g + k).view(rec.units[k][i])[:(hi - lo) * rec.entries[i].dtype.itemsize]

        def payload(storage: Any) -> Any:
            owner = owners.get(storage.data_ptr())
            if owner is None:
                return None
            rec, key = owner
            g = first[(id(rec), key)]
            if rec.chunk:
                return chunks(rec, g, [e.key for e in rec.entries].index(key))
            return rec.tensors(lease_at(g))[key].reshape(-1).view(torch.uint8)

        try:
            save_streamed(self._packed(state), path, payload)
        finally:
            if held[1] is not None:
                held[1].release()
            reader.close()

    def load(self, path: str | os.PathLike) -> None:
        """Restore the state saved by save() (or any state_dict torch.save wrote for these parameters).

        Streamed: the file is memory-mapped and each parameter's state is copied into the pool a piece at
        a time, written to the swap file and its pages dropped, so memory stays within the budget plus one
        page-cache window. Clears the refusal to step that an interrupted step leaves.
        """
        self._check_open()
        self._backward_steps_reset()
        sd = torch.load(os.fspath(path), map_location="cpu", mmap=True, weights_only=True)
        self._load_packed(sd, drop_pages=True)

    def state_dict(self) -> dict[str, Any]:
        """The whole state, in memory, in the wrapped optimizer's format (holds all of it: see save()).

        Also what torch.distributed.checkpoint saves, and (once there is state) the tensors it loads into
        in place before load_state_dict() takes them; torch's get_optimizer_state_dict works on this too.
        """
        self._check_usable()
        self._prune()
        self.swap.check_files()
        order = self._grouped()
        reader = ReadAhead(self.swap, [units for _, rec in order for units in rec.units])
        state: dict[torch.Tensor, dict[str, Any]] = {}
        g = [0]

        def take(_k: int) -> Lease:
            g[0] += 1
            return reader.take(g[0] - 1)

        try:
            for p, rec in order:
                state[p] = _read_record(rec, take)
        finally:
            reader.close()
        return self._packed(state)

    def stepped_as(self, p: torch.Tensor) -> torch.Tensor | None:
        """The tensor this optimizer steps for parameter `p`, which keys its state (a DTensor's view of its
        local shard, `p` itself otherwise); None when `p` is in none of its groups."""
        q = self._views.viewed(p) if is_dtensor(p) else p
        return q if q is not None and id(q) in self._in_groups() else None

    def read_state(self, p: torch.Tensor) -> dict[str, Any]:
        """`p`'s state read from the drive (checked), its tensors fresh memory of their own, its small values
        as they are; {} when it has none (for checkpoint backends: one parameter's state at a time)."""
        self._check_usable()
        rec = self._records.get(p)
        if rec is None or not rec.made:
            return {}
        self.swap.check_files()
        reader = ReadAhead(self.swap, rec.units)
        try:
            return _read_record(rec, reader.take)
        finally:
            reader.close()

    def write_states(self, states: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Replace the state of the parameters in `states` (keys: parameters of the groups, as they are
        stepped: a DTensor's view) by the given state, in torch's per-parameter format; others keep theirs.
        For checkpoint backends loading a part at a time. Refused before anything changes when a state
        would not fit the budget."""
        self._check_open()
        self._backward_steps_reset()
        live = self._in_groups()
        for p in states:
            if id(p) not in live:
                raise ValueError("write_states takes the state of parameters of this optimizer's groups")
        items = [(p, dict(st)) for p, st in states.items()]
        self._check_fits(items)
        before, self._broken = self._broken, "a load was interrupted"
        self.swap.wait_writes()
        for p, _ in items:
            if p in self._records:
                self._drop(p)
        self._put_states(items, drop_pages=False)
        self.swap.wait_writes()
        self._broken = before  # a part written heals nothing else
        self._outline([p for p, _ in items])

    def refuse_steps(self, reason: str | None) -> None:
        """Refuse to step, saying `reason`, until called with None (for loaders that replace the state a
        part at a time: a load that failed half way leaves a mix)."""
        self._broken = reason

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a whole state (as state_dict() gives, or the wrapped optimizer's) onto the drive."""
        self._check_open()
        self._backward_steps_reset()
        self._load_packed(local_state(state_dict), drop_pages=False)

    def _load_packed(self, sd: dict[str, Any], drop_pages: bool) -> None:
        """Replace the whole state by `sd`'s (torch's state_dict format), checked before anything is
        dropped; `drop_pages`: give back the pages of a memory-mapped `sd` as they are copied."""
        if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
            raise ValueError("not an optimizer state dict (needs 'state' and 'param_groups')")
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        by_index: dict[Any, torch.Tensor] = {}
        for live, saved in zip(self.param_groups, saved_groups):
            if len(live["params"]) != len(saved["params"]):
                raise ValueError(f"a group of the state dict has {len(saved['params'])} parameters, "
                                 f"this optimizer's has {len(live['params'])}")
            by_index.update(zip(saved["params"], live["params"]))
        loose, states = {}, []
        for idx, st in sd["state"].items():
            p = by_index.get(idx)
            if p is None and not isinstance(idx, int):
                loose[idx] = st  # state not keyed by a parameter (torch's state_dict keeps such keys as is)
            elif p is None:
                raise ValueError(f"the state dict holds state for parameter {idx!r}, which no group names")
            else:
                states.append((p, dict(st)))
        self._check_fits(states)
        self._broken = "a load was interrupted"
        self.swap.wait_writes()
        for p in list(self._records):  # the state loaded replaces all of it, as with torch's load_state_dict
            self._drop(p)
        self._put_states(states, drop_pages)
        self._loose = loose
        for live, saved in zip(self.param_groups, saved_groups):
            live.update({k: v for k, v in saved.items() if k != "params"})
        self.swap.wait_writes()
        self._broken = None
        self._outline()

    def _check_fits(self, states: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Refuse, before anything is dropped, a state whose one piece would not fit the budget."""
        for p, st in states:
            entries = entries_of(st, p.dtype if self.master_weights else None)
            if self.master_weights and _MASTER not in st:
                entries.append(Entry(_MASTER, torch.float32, p.shape, strides_of(p)))
            need = max(map(sum, layout(entries, p, self.tile_bytes, self._may_chunk(p))[1]))
            if need > self.swap.pool.capacity:
                raise ValueError(f"the loaded state of {self._name(p)} ({[e.key for e in entries]}) takes "
                                 f"{need} bytes in one piece, over budget_bytes={self.swap.pool.capacity}: "
                                 "raise budget_bytes to at least that")

    def _put_states(self, states: list[tuple[torch.Tensor, dict[str, Any]]], drop_pages: bool) -> None:
        """Lay out and write each parameter's state (none of them has a record now)."""
        for p, st in states:
            if self.master_weights and _MASTER not in st:
                st[_MASTER] = p.detach().to(torch.float32, copy=True)
            elif not self.master_weights:
                st.pop(_MASTER, None)
            rec = self._reserve(p, entries_of(st, p.dtype if self.master_weights else None))
            rec.scalars = {k: _own(v) for k, v in st.items() if not is_swapped(k, v)}
            self._write_record(rec, st, release_pages if drop_pages else None)


def _read_record(rec: Record, take: Callable[[int], Lease]) -> dict[str, Any]:
    """One record's state in fresh memory: its small values and each swapped tensor, piece k's lease from
    `take(k)` (released here)."""
    st = dict(rec.scalars)
    whole = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in rec.entries} if rec.chunk else {}
    for k in range(rec.pieces):
        lease = take(k)
        try:
            if not rec.chunk:
                st.update({key: v.clone() for key, v in rec.tensors(lease, k).items()})
                continue
            lo, hi = rec.span(k)
            for key, v in rec.tensors(lease, k).items():
                whole[key].view(-1)[lo:hi].copy_(v)
        finally:
            lease.release()
    return {**st, **whole}


def _own(v: Any) -> Any:
    """A tensor in memory of its own (not a view of a memory-mapped checkpoint)."""
    return v.clone() if isinstance(v, torch.Tensor) else v


def release_pages(t: torch.Tensor) -> None:
    """Release the memory-mapped pages behind `t` (from torch.load(mmap=True); re-read if touched)."""
    start = t.data_ptr() // PAGE * PAGE
    end = round_up(t.data_ptr() + t.numel() * t.element_size())
    if end > start:
        madvise(start, end - start, mmap.MADV_DONTNEED)  # advice: a refusal only keeps the pages
