"""OffloadedOptimizer: a torch.optim optimizer whose state lives on a drive between steps.

Each parameter's swapped state (the tensors of its optimizer state shaped like it, and with
`master_weights` its fp32 master copy) is one unit of the swap space: one contiguous blob, each tensor at
a page boundary in it, so a parameter moves in one read and one write. Small state (Adam's `step`
counters) stays in memory.

step() walks the parameters that have gradients in tiles of about `tile_bytes` (a quarter of the budget
by default). For each tile it reads the units into pool memory (reads run ahead, in order, as far as the
budget allows: ReadAhead), points the wrapped optimizer's `state[p]` at views of that memory, calls the
wrapped optimizer's own step with temporary param groups holding only the tile's parameters (each a
copy of its live group, so hyperparameters, LR schedules and `param_groups` edits apply), and queues the
tile's write-back, which gives the memory back to the pool once written. The arithmetic is therefore the
wrapped optimizer's own, on the same values: results are bit-identical to the optimizer kept in memory.
Each direction keeps two requests in flight (REQUESTS_IN_FLIGHT), so the drive is not left idle at the
tail of every tile's request; the first tile's read and the last tile's read and write are cut into as many
requests (END_REQUESTS), so the ends of the walk fill every slot of the queues. The swap's handles move 4 MiB
blocks (handles.SWAP). `last_step` (a StepProfile) says what the last step moved and when.

With `master_weights=True` the model's parameters may be bf16/fp16: the wrapped optimizer steps fp32
masters (kept on the drive with the state), given the gradients cast to fp32, and the rounded result is
copied into the model.

Interrupted steps: when step() ends by an exception after it began to update tiles (Ctrl-C, an I/O
error), some parameters and their state are updated and others not. The optimizer then refuses to step
(RuntimeError saying why) until load()/load_state_dict() restores a consistent state; it never goes on
silently from the mix. Errors found before any tile is touched (bad input) leave it usable.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepnvme.offload._doors import PAGE, SWAP, madvise, save_streamed
from deepnvme.offload.swap import Closing, Lease, ReadAhead, SwapSpace, Ticket, Unit, budget_arg, round_up
from deepnvme.offload.train.grouping import is_elementwise, whole_step_too_large

# The state key under which checkpoints carry the fp32 master of a parameter (master_weights=True).
MASTER = "master"
# Budget when none is given (bytes of locked memory).
DEFAULT_BUDGET = 256 << 20
# Requests each direction serves at once: with one, the drive idles while each request's last blocks
# complete and the queue issues the next; with two, the next is already in the drive.
REQUESTS_IN_FLIGHT = 2
# Requests the first and the last tile move in (each way): the tile that starts the pipeline and the one
# that ends it, where nothing else is left to overlap with, fill every slot of the queue (see ReadAhead).
END_REQUESTS = REQUESTS_IN_FLIGHT


@dataclass
class _Entry:
    key: str
    offset: int  # in the parameter's unit
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


Span = tuple[float, float, int]  # (began, ended, bytes), time.perf_counter() seconds


@dataclass
class StepProfile:
    """What one step() did and when: a span per read request, per tile update, per write request, and the
    time the step waited for reads. Overlap of these spans is the pipeline at work."""

    began: float
    ended: float = 0.0
    reads: list[Span] = field(default_factory=list)
    updates: list[Span] = field(default_factory=list)  # bytes: the tile's parameters' bytes
    writes: list[Span] = field(default_factory=list)
    read_wait_s: float = 0.0
    #: When each tile's reads were queued (None for a tile with nothing to read): before the update of the
    #: tile ahead of it began, where the read-ahead works.
    tile_reads_queued: list[float | None] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        """Bytes the step read from the drive."""
        return sum(n for *_, n in self.reads)

    @property
    def bytes_written(self) -> int:
        """Bytes the step wrote to the drive: what it wears (every swapped byte once per step)."""
        return sum(n for *_, n in self.writes)

    def add_requests(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            (self.writes if t.write else self.reads).append((t.began, t.ended, t.tensor.numel()))


@dataclass
class _Record:
    """What is known of one parameter's offloaded state."""

    unit: Unit
    entries: list[_Entry]
    shape: torch.Size
    dtype: torch.dtype
    scalars: dict[str, Any] = field(default_factory=dict)

    def tensors(self, lease: Lease) -> dict[str, torch.Tensor]:
        raw = lease.view(self.unit)
        return {e.key: raw[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries}


class OffloadedOptimizer(Closing, torch.optim.Optimizer):
    """Wrap `optimizer` so that its state lives in files under `directory` between steps.

    `budget_bytes` is the locked memory offload uses: the pool every read and write goes through
    (default 256 MiB). It sizes the tiles (`tile_bytes`, default a quarter of it) and how far reads run
    ahead; it must hold the largest parameter's unit (its state tensors, and its master). `handle` is an
    aio handle for reads (default: a new one with the swap's settings, deepnvme._core.handles.SWAP, as
    every other handle of the swap space has).

    Tiles give the optimizer's own arithmetic only for an optimizer that updates each parameter from its
    own state and gradient (torch's, see grouping.py): any other is stepped whole, every parameter in one
    call, its whole state in the budget (else a ValueError before anything moves), unless `elementwise=True`
    says it is element-wise. State it keeps under keys that are not parameters stays in memory, and in
    state_dict() and save().

    Use it as the optimizer: `param_groups` are the wrapped optimizer's live groups (LR schedulers attach
    here), `zero_grad`, `add_param_group` work as usual. `state` is a read-only outline: for each parameter
    with state, its small values (Adam's `step`) and, for each tensor kept on the drive, an empty tensor on
    the "meta" device with its shape and dtype (see state_dict() for the values). It is there so that code
    asking which state exists sees the truth: torch.distributed.checkpoint's get/set_optimizer_state_dict
    take an empty `state` to mean "never stepped" and then run a zero-gradient step to create it, which on
    existing Adam state would decay it. A context manager; close() removes its files.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, directory: str | os.PathLike,
                 budget_bytes: int | None = None, *, master_weights: bool = False, handle: Any = None,
                 tile_bytes: int | None = None, elementwise: bool | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OffloadedOptimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        budget = budget_arg(DEFAULT_BUDGET if budget_bytes is None else budget_bytes)
        self._closed = True  # until the swap space exists
        self.optimizer = optimizer
        self.master_weights = bool(master_weights)
        self.elementwise = is_elementwise(optimizer, elementwise)
        self._loose: dict[Any, Any] = {}  # the wrapped optimizer's state not keyed by a parameter
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            self._check_param(p, f"parameter {i}")
        biggest = max(params, key=lambda p: p.numel(), default=None)
        if biggest is not None and round_up(biggest.numel() * 4) > budget:
            raise ValueError(f"budget_bytes={budget} is smaller than a fp32 state tensor of the largest "
                             f"parameter ({tuple(biggest.shape)}, {biggest.numel() * 4} bytes): raise "
                             "budget_bytes to a few times that")
        state_estimate = sum(round_up(p.numel() * 4) for p in params) * (2 if master_weights else 1)
        self.swap = SwapSpace(directory, budget, handle=handle, expected_bytes=state_estimate,
                              requests_in_flight=REQUESTS_IN_FLIGHT, handle_settings=SWAP)
        self._closed = False
        self.tile_bytes = max(self.swap.pool.capacity // 4, PAGE) if tile_bytes is None else int(tile_bytes)
        self._records: dict[torch.Tensor, _Record] = {}
        self._units = 0
        self._broken: str | None = None
        self.last_step: StepProfile | None = None
        adopted = optimizer.state_dict() if optimizer.state else None
        super().__init__([{"params": []}], optimizer.defaults)
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = defaultdict(dict)
        if adopted is not None:  # state the wrapped optimizer already had moves to the drive
            optimizer.state.clear()
            self.load_state_dict(adopted)

    # --------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of the wrapped optimizer over every parameter with a gradient, tile by tile."""
        self._check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"] if p.grad is not None]
        for _, p in work:
            self._check_param(p, self._name(p))
            if p.grad.is_sparse:
                raise RuntimeError(f"{self._name(p)} has a sparse gradient: OffloadedOptimizer does not take "
                                   "sparse gradients (use a dense gradient, or an in-memory optimizer)")
            rec = self._records.get(p)
            if rec is not None and (p.shape != rec.shape or p.dtype != rec.dtype):
                raise ValueError(f"{self._name(p)} changed from {tuple(rec.shape)} {rec.dtype} to "
                                 f"{tuple(p.shape)} {p.dtype} since its state was made: the offloaded state "
                                 "cannot follow; make a new optimizer (or load a checkpoint made for it)")
        self.swap.check_files()
        tiles = self._tiles(work)
        ahead = all(p in self._records for _, p in work)  # new state is allocated mid-step: no read-ahead
        reader = ReadAhead(self.swap, [[self._records[p].unit for _, p in t if p in self._records]
                                       for t in tiles], ahead=ahead, end_parts=END_REQUESTS)
        self._broken = "a step() was interrupted"
        profile = StepProfile(time.perf_counter())
        writes: list[Ticket] = []
        try:
            for i, tile in enumerate(tiles):
                waited = time.perf_counter()
                lease = reader.take(i)
                began = time.perf_counter()
                profile.read_wait_s += began - waited
                profile.tile_reads_queued.append(min(t.queued for t in lease.tickets)
                                                 if lease is not None and lease.tickets else None)
                if lease is not None:
                    profile.add_requests(lease.tickets)
                try:
                    fresh = self._step_tile(tile, lease)
                except BaseException:
                    if lease is not None:
                        lease.release()
                    raise
                profile.updates.append((began, time.perf_counter(),
                                        sum(p.numel() * p.element_size() for _, p in tile)))
                if lease is not None:
                    writes += lease.write_back(END_REQUESTS if i == len(tiles) - 1 else 1)
                if fresh:  # after the write-back is queued: its memory comes back as it lands
                    self._store_fresh(fresh)
            self.swap.wait_writes()
            profile.add_requests(writes)
            profile.ended = time.perf_counter()
            self.last_step = profile
        except BaseException as exc:
            reader.close()
            try:
                self.swap.wait_writes()
            except OSError:
                pass
            self._broken = (f"a step() ended by {type(exc).__name__}: {exc}" if str(exc)
                            else f"a step() ended by {type(exc).__name__}")
            raise
        self._broken = None
        self._outline()
        return loss

    def _tiles(self, work: list[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
        """The work in tiles of about tile_bytes (see grouping.py); all of it in one for an optimizer that
        is not element-wise, refused before anything moves when its state would not fit the pool."""
        tiles: list[list[tuple[int, torch.Tensor]]] = []
        size = total = 0
        for gi, p in work:
            rec = self._records.get(p)
            n = rec.unit.io_nbytes if rec else round_up(p.numel() * 4) * (3 if self.master_weights else 2)
            if not tiles or (self.elementwise and size + n > self.tile_bytes):
                tiles.append([])
                size = 0
            tiles[-1].append((gi, p))
            size += n
            total += round_up(n)  # new state: as much as Adam's (with masters), the largest of torch's
        if not self.elementwise and total > self.swap.pool.capacity:
            raise whole_step_too_large(self.optimizer, total, self.swap.pool.capacity)
        return tiles or ([] if self.elementwise else [[]])  # stepped whole: one call even with no gradient

    def _step_tile(self, tile: list[tuple[int, torch.Tensor]],
                   lease: Lease | None) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Step the parameters of `tile` (their state in `lease`); the state made for parameters that had
        none, to be stored once the lease is written back."""
        inner = self.optimizer
        targets: dict[torch.Tensor, torch.Tensor] = {}
        for _, p in tile:
            rec = self._records.get(p)
            views = rec.tensors(lease) if rec is not None else {}
            if self.master_weights:
                target = views.pop(MASTER) if rec is not None else p.detach().to(torch.float32, copy=True)
                target.grad = p.grad.to(torch.float32)
            else:
                target = p
            targets[p] = target
            if rec is not None:
                inner.state[target] = {**views, **rec.scalars}
        groups = []
        for gi, group in enumerate(self.param_groups):
            chosen = [targets[p] for g, p in tile if g == gi]
            if chosen or not self.elementwise:  # stepped whole: every group, as its step in memory sees them
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": chosen})
        live = inner.param_groups
        inner.state.update(self._loose)
        try:
            inner.param_groups = groups
            inner.step()
        finally:
            inner.param_groups = live
            after = {p: inner.state.pop(targets[p], None) for _, p in tile}
            self._loose = dict(inner.state)
            inner.state.clear()
        if not self.elementwise:  # stepped whole: what it wrote to its groups is theirs
            for group, copy in zip(live, groups):
                group.update({k: v for k, v in copy.items() if k != "params"})
        fresh: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for _, p in tile:
            target, state = targets[p], after[p]
            if self.master_weights:
                target.grad = None
                p.copy_(target)
                # Stored even when the optimizer keeps no state (SGD without momentum): the master is what
                # makes the next step fp32 arithmetic rather than the 16-bit parameter's.
                state = {**(state or {}), MASTER: target}
            if state is None:
                continue
            rec = self._records.get(p)
            if rec is None:
                fresh.append((p, state))
                continue
            views = rec.tensors(lease)
            swapped = {k for k, v in state.items() if self._is_swapped(p, k, v)}
            if swapped != set(views):
                raise RuntimeError(f"the wrapped optimizer's state of {self._name(p)} changed from "
                                   f"{sorted(views)} to {sorted(swapped)}")
            for k in swapped:
                if state[k].data_ptr() != views[k].data_ptr():
                    views[k].copy_(state[k])
            rec.scalars = {k: v for k, v in state.items() if k not in swapped}
        return fresh

    def _outline(self) -> None:
        """Make `state` show, per parameter, its small state and a meta tensor for each swapped one."""
        def outline(rec: _Record) -> dict[str, Any]:
            return {**rec.scalars, **{e.key: torch.empty(e.shape, dtype=e.dtype, device="meta")
                                      for e in rec.entries}}

        self.state = defaultdict(dict, {p: outline(rec) for p, rec in self._records.items()})

    def _is_swapped(self, p: torch.Tensor, key: str, value: Any) -> bool:
        return (key != "step" and isinstance(value, torch.Tensor) and value.shape == p.shape
                and value.numel() > 0)

    def _store_fresh(self, fresh: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Lay out new parameters' state as units and write it (each state made in plain memory first)."""
        for p, state in fresh:
            rec = self._new_record(p, state)
            lease = self.swap.allocate([rec.unit])
            views = rec.tensors(lease)
            for k, v in views.items():
                v.copy_(state[k])
            lease.write_back()

    def _new_record(self, p: torch.Tensor, state: dict[str, Any], promote: bool = False) -> _Record:
        entries, at = [], 0
        for k, v in state.items():
            if self._is_swapped(p, k, v):
                # State keeps its own dtype (an optimizer may keep fp32 moments of 16-bit parameters). Only
                # state taken over (adopted, loaded) for an fp32 master in the 16-bit parameter's dtype
                # becomes fp32: Adagrad makes its sums at construction, in the parameter's dtype, where the
                # same optimizer over fp32 masters makes fp32 ones.
                dtype = (torch.float32 if promote and v.is_floating_point() and v.dtype == p.dtype
                         and p.dtype != torch.float32 else v.dtype)
                entries.append(_Entry(k, at, dtype, v.shape))
                at += round_up(v.numel() * dtype.itemsize)
        self._units += 1
        unit = self.swap.add(f"param-{self._units}", max(at, 1))
        rec = _Record(unit, entries, p.shape, p.dtype,
                      {k: v for k, v in state.items() if not self._is_swapped(p, k, v)})
        self._records[p] = rec
        return rec

    # ------------------------------------------------------------------------------------- checkpoints
    def _placeholders(self) -> tuple[dict[torch.Tensor, dict[str, Any]], dict[int, tuple[_Record, str]]]:
        """State dicts whose swapped tensors are untouched anonymous memory (no RSS), and their owners."""
        state: dict[torch.Tensor, dict[str, Any]] = {}
        owners: dict[int, tuple[_Record, str]] = {}
        for p, rec in self._records.items():
            st = dict(rec.scalars)
            for e in rec.entries:
                t = torch.frombuffer(mmap.mmap(-1, max(e.nbytes, 1)), dtype=torch.uint8)[:e.nbytes]
                t = t.view(e.dtype).view(e.shape)
                owners[t.untyped_storage().data_ptr()] = (rec, e.key)
                st[e.key] = t
            state[p] = st
        return state, owners

    def _packed(self, state: dict[torch.Tensor, dict[str, Any]]) -> dict[str, Any]:
        inner = self.optimizer
        inner.state = defaultdict(dict, {**state, **self._loose})
        try:
            return inner.state_dict()
        finally:
            inner.state = defaultdict(dict)

    def _records_in_order(self) -> list[_Record]:
        return list(self._records.values())

    def save(self, path: str | os.PathLike) -> None:
        """Write the whole optimizer state to `path` in torch's format (deepnvme.save: atomic, O_DIRECT).

        Streamed unit by unit through the pool: the state is never all in memory. The file is what
        `state_dict()` would give: a plain optimizer's `load_state_dict(torch.load(path))` takes it (with
        master weights, each parameter's state also holds its fp32 master under "master").
        """
        self._check_usable()
        self.swap.check_files()
        state, owners = self._placeholders()
        order = self._records_in_order()
        index = {id(rec): i for i, rec in enumerate(order)}
        reader = ReadAhead(self.swap, [[rec.unit] for rec in order])
        current: list[Any] = [-1, None]  # index of the record whose lease is held, the lease

        def payload(storage: Any) -> torch.Tensor | None:
            owner = owners.get(storage.data_ptr())
            if owner is None:
                return None
            rec, key = owner
            i = index[id(rec)]
            if current[0] != i:
                if current[1] is not None:
                    current[1].release()
                    current[1] = None
                if i < current[0]:
                    raise RuntimeError("torch.save asked for the state out of order")
                while current[0] < i:  # units torch never asked for (none are expected) are skipped
                    current[0] += 1
                    lease = reader.take(current[0])
                    if current[0] < i and lease is not None:
                        lease.release()
                    else:
                        current[1] = lease
            view = rec.tensors(current[1])[key]
            return view.reshape(-1).view(torch.uint8)

        try:
            save_streamed(self._packed(state), path, payload)
        finally:
            if current[1] is not None:
                current[1].release()
            reader.close()

    def load(self, path: str | os.PathLike) -> None:
        """Restore the state saved by save() (or any state_dict torch.save wrote for these parameters).

        Streamed: the file is memory-mapped and each parameter's state is copied into the pool, written
        to the swap file and its pages dropped, so memory stays within the budget plus one page-cache
        window. Clears the refusal to step that an interrupted step leaves.
        """
        self._check_open()
        sd = torch.load(os.fspath(path), map_location="cpu", mmap=True, weights_only=True)
        self._load_packed(sd, drop_pages=True)

    def state_dict(self) -> dict[str, Any]:
        """The whole state, in memory, in the wrapped optimizer's format (holds all of it: see save()).

        Also what torch.distributed.checkpoint saves, and (once there is state) the tensors it loads into
        in place before load_state_dict() takes them; torch's get_optimizer_state_dict works on this too.
        """
        self._check_usable()
        self.swap.check_files()
        order = self._records_in_order()
        reader = ReadAhead(self.swap, [[rec.unit] for rec in order])
        state: dict[torch.Tensor, dict[str, Any]] = {}
        params = {id(rec): p for p, rec in self._records.items()}
        try:
            for i, rec in enumerate(order):
                lease = reader.take(i)
                try:
                    st = dict(rec.scalars)
                    st.update({k: v.clone() for k, v in rec.tensors(lease).items()})
                finally:
                    lease.release()
                state[params[id(rec)]] = st
        finally:
            reader.close()
        return self._packed(state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a whole state (as state_dict() gives, or the wrapped optimizer's) onto the drive."""
        self._check_open()
        self._load_packed(state_dict, drop_pages=False)

    def _load_packed(self, sd: dict[str, Any], drop_pages: bool) -> None:
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
        self._broken = "a load was interrupted"
        self.swap.wait_writes()
        kept, loose = {}, {}
        for idx, st in sd["state"].items():
            p = by_index.get(idx)
            if p is None and not isinstance(idx, int):
                loose[idx] = st  # state not keyed by a parameter (torch's state_dict keeps such keys as is)
                continue
            if p is None:
                raise ValueError(f"the state dict holds state for parameter {idx!r}, which no group names")
            st = dict(st)
            if self.master_weights and MASTER not in st:
                st[MASTER] = p.detach().to(torch.float32, copy=True)
            elif not self.master_weights:
                st.pop(MASTER, None)
            old = self._records.pop(p, None)
            rec = (self._new_record(p, st, promote=self.master_weights)
                   if old is None or not self._same_layout(p, old, st) else old)
            if rec is old:
                self._records[p] = rec
                rec.scalars = {k: _own(v) for k, v in st.items() if not self._is_swapped(p, k, v)}
            else:
                rec.scalars = {k: _own(v) for k, v in rec.scalars.items()}
            lease = self.swap.allocate([rec.unit])
            try:
                for k, v in rec.tensors(lease).items():
                    v.copy_(st[k])
                    if drop_pages:
                        _drop_pages(st[k])
            except BaseException:
                lease.release()
                raise
            lease.write_back()
            kept[p] = rec
        self._records = kept  # parameters without saved state start afresh, as with torch's load_state_dict
        self._loose = loose
        for live, saved in zip(self.param_groups, saved_groups):
            live.update({k: v for k, v in saved.items() if k != "params"})
        self.swap.wait_writes()
        self._broken = None
        self._outline()

    def _same_layout(self, p: torch.Tensor, rec: _Record, st: dict[str, Any]) -> bool:
        swapped = [(k, v.shape) for k, v in st.items() if self._is_swapped(p, k, v)]
        return swapped == [(e.key, e.shape) for e in rec.entries] and rec.shape == p.shape

    # -------------------------------------------------------------------------------------------- life
    def _name(self, p: torch.Tensor) -> str:
        for gi, g in enumerate(self.param_groups):
            for i, q in enumerate(g["params"]):
                if q is p:
                    return f"parameter {i} of group {gi}"
        return "a parameter"

    def _check_param(self, p: torch.Tensor, name: str) -> None:
        if p.device.type != "cpu":
            raise ValueError(f"{name} is on {p.device}: OffloadedOptimizer steps CPU parameters")
        if self.master_weights and not p.is_floating_point():
            raise ValueError(f"{name} is {p.dtype}: master weights need floating-point parameters")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this OffloadedOptimizer is closed (its state files are gone); make a new one "
                               "and load() a checkpoint")

    def _check_usable(self) -> None:
        self._check_open()
        if self._broken is not None:
            raise RuntimeError(f"{self._broken}, so parameters and optimizer state may be a mix of updated "
                               "and old tiles; this optimizer refuses to step until load(path) or "
                               "load_state_dict() restores a consistent state")

    @property
    def budget_bytes(self) -> int:
        """The locked memory of the pool."""
        return self.swap.pool.capacity

    def close(self) -> None:
        """Wait for queued writes, free the locked memory and remove the state files (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.swap.close()


    def __repr__(self) -> str:
        return (f"OffloadedOptimizer({type(self.optimizer).__name__}, {self.swap.directory!r}, "
                f"budget_bytes={self.budget_bytes}, master_weights={self.master_weights})")


def _own(v: Any) -> Any:
    """A tensor in memory of its own (not a view of a memory-mapped checkpoint)."""
    return v.clone() if isinstance(v, torch.Tensor) else v


def _drop_pages(t: torch.Tensor) -> None:
    """Release the memory-mapped pages behind `t` (from torch.load(mmap=True); re-read if touched)."""
    start = t.data_ptr() // PAGE * PAGE
    end = round_up(t.data_ptr() + t.numel() * t.element_size())
    if end > start:
        madvise(start, end - start, mmap.MADV_DONTNEED)  # advice: a refusal only keeps the pages


