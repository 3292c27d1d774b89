"""OffloadedOptimizer: a torch.optim optimizer whose state lives on a drive between steps.

Each parameter's swapped state (the tensors of its optimizer state, and with `master_weights` its fp32
master copy) lies in units of the swap space (records.py: whole, or in chunks for a parameter larger than a
tile); small state (Adam's `step` counters) stays in memory. The state's layout is learnt before the first
step by a step on the meta device (probe.py), so the swap file is sized, and checked against the budget and
the drive's free space, before anything moves.

step() walks the pieces (a parameter, or a chunk of one) that have gradients in tiles of about `tile_bytes`
(a quarter of the budget by default). For each tile it reads the units into pool memory (reads run ahead,
in order, as far as the budget allows: ReadAhead), points the wrapped optimizer's `state` at views of that
memory, calls the wrapped optimizer's own step with temporary param groups holding only the tile's pieces
(each a copy of its live group, so hyperparameters, LR schedules and `param_groups` edits apply), and queues
the tile's write-back, which gives the memory back to the pool once written. The arithmetic is therefore
the wrapped optimizer's own, on the same values: results are bit-identical to the optimizer kept in memory.
Each direction keeps two requests in flight (REQUESTS_IN_FLIGHT); the first tile's read and the last tile's
read and write are cut into as many requests (END_REQUESTS), so the ends of the walk fill every slot of the
queues. `last_step` (a StepProfile) says what the last step moved and when.

With `master_weights=True` the model's parameters may be bf16/fp16: the wrapped optimizer steps fp32
masters (kept on the drive with the state), given the gradients cast to fp32, and the rounded result is
copied into the model.

Parameters on a GPU: the step runs on the parameter's device. A tile's state goes drive -> pool (locked host
memory) -> device, is stepped there by the wrapped optimizer with the device's own kernels, and comes back
the same way; gradients and parameters never leave the device. Stepping on the host instead (as
DeepSpeed's CPU Adam does) would use other kernels than the same optimizer on the GPU, so it would not be
the same arithmetic; the state crosses the bus twice a step, less than the drive's own read and write of it.

Interrupted steps: when step() ends by an exception after it began to update tiles (Ctrl-C, an I/O
error), some parameters and their state are updated and others not. The optimizer then refuses to step
(RuntimeError saying why) until load()/load_state_dict() restores a consistent state; it never goes on
silently from the mix. Errors found before any tile is touched (bad input, no room) leave it usable.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from deepnvme.offload._doors import PAGE, SWAP
from deepnvme.offload.swap import Closing, Lease, SwapSpace, budget_arg, check_memory_room, directory_arg
from deepnvme.offload.train.backward_step import StepsInBackward, check_can_step
from deepnvme.offload.train.checkpoints import Checkpoints
from deepnvme.offload.train.checks import Checks
from deepnvme.offload.train.dtensors import ShardViews, is_dtensor
from deepnvme.offload.train.grouping import how_stepped, whole_step_too_large
from deepnvme.offload.train.held import HIDDEN_ATTR
from deepnvme.offload.train.lending import Lending, applied_in_backward, owner_of, zero_offloaded_grads
from deepnvme.offload.train.probe import Prober
from deepnvme.offload.train.profile import StepProfile
from deepnvme.offload.train.rank_errors import agree, group_of
from deepnvme.offload.train.records import (
    REDUCED,
    Entry,
    Record,
    check_values,
    entries_of,
    in_lease,
    is_swapped,
    layout,
    least_piece,
    strides_of,
)
from deepnvme.offload.train.shard_lending import by_unit, shard_lending
from deepnvme.offload.train.tile_walk import REQUESTS_IN_FLIGHT, Piece, TileWalk
from deepnvme.offload.train.wrapped import needs_closure, step_unhooked

# The state key under which checkpoints carry the fp32 master of a parameter (master_weights=True).
MASTER = "master"
# Budget when none is given (bytes of locked memory).
DEFAULT_BUDGET = 256 << 20
# Devices a parameter may be on: the host, or a GPU (its state staged through the host's pool).
DEVICES = ("cpu", "cuda")



class OffloadedOptimizer(Checks, Checkpoints, StepsInBackward, TileWalk, Closing, torch.optim.Optimizer):
    """Wrap `optimizer` so that its state lives in files under `directory` (created with its parents when
    missing) between steps.

    `budget_bytes` is the locked memory offload uses: the pool every read and write goes through
    (default 256 MiB). It sizes the tiles (`tile_bytes`, default a quarter of it) and how far reads run
    ahead. A parameter of any size can be stepped by an element-wise optimizer (a chunk at a time); any
    other needs each parameter's whole state in the budget. What a configuration needs is computed when the
    optimizer is made (`swap_bytes`: the drive; `min_budget_bytes`: the pool), and a budget or a drive that
    cannot hold it is refused then, with the number. `handle` is an aio handle for reads (default: a new one
    with the swap's settings, deepnvme._core.handles.SWAP, as every other handle of the swap space has).

    Tiles give the optimizer's own arithmetic only for an optimizer that updates each parameter from its
    own state and gradient (torch's, see grouping.py): any other is stepped whole, every parameter in one
    call, its whole state in the budget (else a ValueError before anything moves), unless `elementwise=True`
    says it is. A parameter larger than a tile is stepped a chunk of its elements at a time when every
    tensor of its state is shaped like it, the optimizer updates each element from that element's state
    alone (torch's element-wise optimizers, or any with `chunks=True`; Adafactor, a trust ratio per
    parameter: not) and the arithmetic is fp32 (a bf16/fp16 parameter with master weights; not without).
    State it keeps under keys that are not parameters stays in memory, and in
    state_dict() and save(). State of any shape and dtype is swapped as it is; state the swap cannot carry
    exactly (tensors in lists, sparse or quantized tensors) is refused with a TypeError naming it.

    Use it as the optimizer: `param_groups` are the wrapped optimizer's live groups (LR schedulers attach
    here), `zero_grad`, `add_param_group` work as usual. As with torch's optimizers, a parameter taken out
    of every group keeps its state (added back, it goes on from it) until `opt.state.pop(p)`, which drops
    it and gives its swap space back; state_dict() and save() leave out parameters in no group (where
    torch's raise KeyError). `state` is a read-only
    outline: for each parameter with state, its small values (Adam's `step`) and, for each tensor kept on
    the drive, an empty tensor on the "meta" device with its shape and dtype (see state_dict() for the
    values). It is there so that code asking which state exists sees the truth:
    torch.distributed.checkpoint's get/set_optimizer_state_dict take an empty `state` to mean "never
    stepped" and then run a zero-gradient step to create it, which on existing Adam state would decay it.
    A context manager; close() removes its files.
    """

    #: Stage state through separate tensors even for host parameters, as for a GPU's (tests of that path).
    _STAGE_ON_HOST = False

    def __init__(self, optimizer: torch.optim.Optimizer, directory: str | os.PathLike,
                 budget_bytes: int | None = None, *, master_weights: bool = False, handle: Any = None,
                 tile_bytes: int | None = None, elementwise: bool | None = None,
                 chunks: bool | None = None, step_in_backward: bool = False) -> None:
        self._closed = True
        # Over FSDP2's shards every rank makes its optimizer: one rank's refusal is every rank's.
        groups = getattr(optimizer, "param_groups", [])
        shard = next((p for g in groups for p in g["params"] if is_dtensor(p)), None)
        try:
            agree(lambda: self._make(optimizer, directory, budget_bytes, master_weights, handle, tile_bytes,
                                     elementwise, chunks, step_in_backward),
                  None if shard is None else group_of(shard))
        except BaseException:
            if not self._closed:  # made here, refused on another rank: the caller's optimizer as it was
                self._views.give_back(optimizer.param_groups)
                self.close()
            raise

    def _make(self, optimizer: torch.optim.Optimizer, directory: str | os.PathLike, budget_bytes: int | None,
              master_weights: bool, handle: Any, tile_bytes: int | None, elementwise: bool | None,
              chunks: bool | None, step_in_backward: bool) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OffloadedOptimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        budget = budget_arg(DEFAULT_BUDGET if budget_bytes is None else budget_bytes)
        self._closed = True  # until the swap space exists
        if step_in_backward:  # refused before anything changes
            check_can_step(optimizer, how_stepped(optimizer, elementwise, chunks)[0])
        if needs_closure(optimizer):
            raise TypeError(f"{type(optimizer).__name__}.step needs a closure (it evaluates the loss several "
                            "times a step, over all parameters at once): it cannot be stepped with its state "
                            "on a drive; keep it in memory")
        directory_arg(directory)
        self.optimizer = optimizer
        self.master_weights = bool(master_weights)
        self.elementwise, self.chunks = how_stepped(optimizer, elementwise, chunks)
        if tile_bytes is not None and (isinstance(tile_bytes, bool) or not isinstance(tile_bytes, int)
                                       or tile_bytes <= 0):
            raise ValueError(f"tile_bytes must be a positive int (bytes of state per tile), got "
                             f"{tile_bytes!r}")
        if tile_bytes is not None and tile_bytes > budget:
            raise ValueError(f"tile_bytes={tile_bytes} is more than budget_bytes={budget}: a tile is read "
                             "into the budget whole; give at most budget_bytes (a quarter of it lets reads "
                             "run ahead)")
        self.tile_bytes = max(budget // 4, PAGE) if tile_bytes is None else tile_bytes
        self._probe = Prober(optimizer)
        self._loose: dict[Any, Any] = {}  # the wrapped optimizer's state not keyed by a parameter
        adopted = optimizer.state_dict() if optimizer.state else None  # before DTensors are viewed
        self._views = ShardViews()  # FSDP2's DTensor parameters: stepped through views of their shards
        params = [(gi, self._views.view_of(p)) for gi, g in enumerate(optimizer.param_groups)
                  for p in g["params"]]  # put in the groups once nothing can fail
        for i, (_, p) in enumerate(params):
            self._check_param(p, f"parameter {i}")
        self.swap_bytes, self.min_budget_bytes, exact = self._plan(params)
        if self.min_budget_bytes > budget and not self.elementwise:
            raise whole_step_too_large(optimizer, self.min_budget_bytes, budget, exact)
        if self.min_budget_bytes > budget:
            raise ValueError(f"budget_bytes={budget} is less than this optimizer needs: "
                             f"{self.min_budget_bytes} bytes{'' if exact else ' (estimated)'} "
                             f"({self._need}); "
                             f"raise budget_bytes to at least {self.min_budget_bytes}")
        # The pool it locks, and what the step of a model offloaded by offload_parameters is still to take
        # (counted there against the memory of that time, not yet used: the two checks must add up).
        owners = {id(o): o for g in optimizer.param_groups for p in g["params"] if (o := owner_of(p))}
        steps = sum(o.step_bytes for o in owners.values())
        what = f"OffloadedOptimizer(budget_bytes={budget})"
        check_memory_room(budget + steps, what + (f" with the training step of the offloaded model ({steps} "
                                                  "bytes)" if steps else ""))
        self.swap = SwapSpace(directory, budget, handle=handle, expected_bytes=self.swap_bytes,
                              requests_in_flight=REQUESTS_IN_FLIGHT, handle_settings=SWAP)
        self._closed = False
        self._views.take(optimizer.param_groups)
        self._records: dict[torch.Tensor, Record] = {}
        self._made: set[torch.Tensor] = set()  # parameters whose state existed when the step began
        self._flat_grads: dict[torch.Tensor, torch.Tensor] = {}  # a step's flattened gradients (chunks)
        self._lent: dict[torch.Tensor, torch.Tensor] = {}  # offloaded parameters in memory (lending.py)
        self._units = 0
        self._broken: str | None = None
        self.last_step: StepProfile | None = None
        super().__init__([{"params": []}], optimizer.defaults)
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = defaultdict(dict)
        if adopted is not None:  # state the wrapped optimizer already had moves to the drive
            optimizer.state.clear()
            self.load_state_dict(adopted)
        self.step_in_backward = step_in_backward

    # --------------------------------------------------------------------------------------- planning
    def _entries(self, gi: int, p: torch.Tensor) -> tuple[list[Entry], bool] | None:
        """The swapped tensors `p`'s state will have (the master's included), and whether it will have any
        state; None when the optimizer's step cannot be tried ahead (probe.py)."""
        probed = self._probe(gi, p, torch.float32 if self.master_weights else p.dtype)
        if probed is None:
            return None
        entries, made = probed
        if self.master_weights:
            return [*entries, Entry(MASTER, torch.float32, p.shape, strides_of(p))], True
        return entries, made

    def _plan(self, params: list[tuple[int, torch.Tensor]]) -> tuple[int, int, bool]:
        """(bytes of the drive, least budget in bytes, whether both are exact) for `params`' state; `_need`
        says what takes the least budget. Exact where the state was learnt ahead; otherwise Adam's (two
        tensors like the parameter, and the master) is assumed."""
        swap = least = 0
        exact = True
        self._need = "nothing"
        for gi, p in params:
            known = self._entries(gi, p)
            if known is None:
                exact = False
                dtype = torch.float32 if self.master_weights else p.dtype
                entries = [Entry(k, dtype, p.shape) for k in ("exp_avg", "exp_avg_sq")]
                if self.master_weights:
                    entries.append(Entry(MASTER, torch.float32, p.shape, strides_of(p)))
            else:
                entries = known[0]
            if not entries:
                continue
            _, sizes = layout(entries, p, self.tile_bytes, self._may_chunk(p))
            swap += sum(map(sum, sizes))
            piece = least_piece(entries, p, self._may_chunk(p))
            if self.elementwise and piece > least:
                least = piece
                self._need = (f"{self._name(p)} {tuple(p.shape)} {p.dtype}: its state "
                              f"{[e.key for e in entries]} in one piece")
        if not self.elementwise and swap > least:
            least = swap
            self._need = f"{type(self.optimizer).__name__} is stepped whole: all its state at once"
        return swap, least, exact

    def _reserve(self, p: torch.Tensor, entries: list[Entry]) -> Record:
        """A record for `p`'s state `entries`, its units added to the swap file (whole or in chunks)."""
        chunk, sizes = layout(entries, p, self.tile_bytes, self._may_chunk(p))
        if max(map(sum, sizes)) > self.swap.pool.capacity:
            what = "stepped whole" if not chunk else "a chunk"
            raise ValueError(f"the state of {self._name(p)} ({tuple(p.shape)} {p.dtype}: "
                             f"{[e.key for e in entries]}) takes {max(map(sum, sizes))} bytes {what}, over "
                             f"budget_bytes={self.swap.pool.capacity}: raise budget_bytes to at least that")
        self._units += 1
        units = []
        try:
            for k, piece in enumerate(sizes):
                names = ([f"param-{self._units}"] if not chunk else
                         [f"param-{self._units}.{k}.{e.key}" for e in entries])
                units.append([])
                for name, n in zip(names, piece):
                    units[-1].append(self.swap.add(name, n))
        except BaseException:
            for u in (u for us in units for u in us):
                self.swap.remove(u)
            raise
        rec = Record(entries, p.shape, p.dtype, units, chunk)
        self._records[p] = rec
        return rec

    def _may_chunk(self, p: torch.Tensor) -> bool:
        """Whether `p` may be stepped in chunks: an element-wise optimizer, stepping fp32 (or wider)
        arithmetic: a master, or the parameter itself (records.py says why not 16-bit)."""
        return self.chunks and (self.master_weights or p.dtype not in REDUCED)

    def _drop(self, p: torch.Tensor) -> None:
        """Forget `p`'s state and give its swap space back."""
        rec = self._records.pop(p)
        for u in rec.all_units:
            self.swap.remove(u)

    def _prune(self) -> None:
        """Drop the state of parameters whose entry the caller removed from `state` (`opt.state.pop(p)`, as
        with torch's optimizers: their space on the drive comes back) or emptied (`opt.state[p] = {}` or
        `.clear()`: the next step makes it afresh, as torch's would)."""
        for p in [p for p, rec in self._records.items() if rec.made and not self.state.get(p)]:
            self._drop(p)

    def _in_groups(self) -> set[int]:
        """ids of the parameters of every group: state of others is kept but left out of state_dict()."""
        return {id(p) for g in self.param_groups for p in g["params"]}

    # --------------------------------------------------------------------------------------------- step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of the wrapped optimizer over every parameter with a gradient, tile by tile. Over
        FSDP2's shards a rank's failure is raised on every rank of their mesh (rank_errors.agree)."""
        shard = next(iter(self._views.dtensor_of.values()), None)
        return agree(lambda: self._step(closure), None if shard is None else group_of(shard))

    @torch.no_grad()
    def _step(self, closure: Callable[[], Any] | None) -> Any:
        self._check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prune()
        self._views.take(self.param_groups)
        self._views.sync()
        self._check_owners_open()
        self._backward_steps_begin()
        work = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]
                if p.grad is not None and not applied_in_backward(p)]
        for _, p in work:
            self._check_work(p)
        self.swap.check_files()
        if self.elementwise and len(self._views):
            work = by_unit(work, self._views)  # each offloaded unit brought once, in one run of tiles
        tiles = self._make_records(work)
        in_tiles = [[p for _, p, _ in t] for t in tiles]
        lending = shard_lending(in_tiles, self._views) or Lending(in_tiles)
        for hook in list(self.optimizer._optimizer_step_pre_hooks.values()):  # once a step, not per tile
            hook(self.optimizer, (), {})
        self.last_step = self._run_tiles(work, tiles, lending)
        self._backward_steps_into(self.last_step)
        self._outline()
        for hook in list(self.optimizer._optimizer_step_post_hooks.values()):
            hook(self.optimizer, (), {})
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients of offloaded parameters are dropped or marked zero without any I/O."""
        back = zero_offloaded_grads([p for g in self.param_groups for p in g["params"]], set_to_none)
        super().zero_grad(set_to_none)
        self._views.zero_grad(set_to_none)
        for p, marker in back:
            p.grad = marker

    def _make_records(self, work: list[tuple[int, torch.Tensor]]) -> list[list[Piece]]:
        """The tiles of `work`'s pieces, after reserving swap space for parameters stepped for the first time
        (all or none: a full drive or a budget too small is an error before anything moves)."""
        made = []
        try:
            for gi, p in work:
                if p in self._records:
                    self._check_chunked(gi, p)
                    continue
                known = self._entries(gi, p)
                if known is not None and (known[0] or known[1]):
                    self._reserve(p, known[0] or []).made = False
                    made.append(p)
            return self._tiles([(gi, p, k) for gi, p in work
                                for k in range(self._records[p].pieces if p in self._records else 1)])
        except BaseException:
            for p in made:
                self._drop(p)
            raise

    def _tiles(self, pieces: list[Piece]) -> list[list[Piece]]:
        """The pieces in tiles of about tile_bytes (see grouping.py); all of them in one for an optimizer that
        is not element-wise, refused before anything moves when its state would not fit the pool."""
        tiles: list[list[Piece]] = []
        size = total = 0
        for gi, p, k in pieces:
            rec = self._records.get(p)
            # state made in memory at its first step: as much as Adam's (with masters), the largest of torch's
            n = (sum(u.io_nbytes for u in rec.units[k]) if rec is not None
                 else p.numel() * 4 * (3 if self.master_weights else 2))
            if not tiles or (self.elementwise and size + n > self.tile_bytes):
                tiles.append([])
                size = 0
            tiles[-1].append((gi, p, k))
            size += n
            total += n
        if not self.elementwise and total > self.swap.pool.capacity:
            raise whole_step_too_large(self.optimizer, total, self.swap.pool.capacity)
        return tiles or ([] if self.elementwise else [[]])  # stepped whole: one call even with no gradient

    def _step_tile(self, tile: list[Piece], lease: Lease | None,
                   starts: dict[torch.Tensor, dict[str, Any]]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Step the pieces of `tile` (their state in `lease`); the state made in memory for parameters
        without a fitting record, to be stored once the lease is written back."""
        inner = self.optimizer
        targets: dict[tuple[torch.Tensor, int], torch.Tensor] = {}
        for _, p, k in tile:
            rec = self._records.get(p)
            here = self._lent.get(p, p)  # an offloaded parameter: its values in memory for this step
            lo, hi = rec.span(k) if rec is not None else (0, p.numel())
            whole = rec is None or not rec.chunk
            made = p in self._made  # as the step began: chunks after the first are made by then too
            views = self._stage(rec.tensors(lease, k), p) if rec is not None and made else {}
            if not whole and p not in self._flat_grads:
                self._flat_grads[p] = here.grad.reshape(-1)  # a copy once per step if not contiguous
            grad = here.grad if whole else self._flat_grads[p][lo:hi]
            if self.master_weights:
                target = views.pop(MASTER, None)
                if target is None:
                    own = here.detach() if whole else here.detach().view(-1)[lo:hi]
                    target = own.to(torch.float32, copy=True)
                target.grad = grad.to(torch.float32)
            else:
                target = here if whole else here.detach().view(-1)[lo:hi]
                if not whole:
                    target.grad = grad
            targets[(p, k)] = target
            if rec is not None and made:
                inner.state[target] = {**views, **(_copied(starts[p]) if rec.chunk else rec.scalars)}
        groups = []
        for gi, group in enumerate(self.param_groups):
            chosen = [targets[(p, k)] for g, p, k in tile if g == gi]
            if chosen or not self.elementwise:  # stepped whole: every group, as its step in memory sees them
                groups.append({**{key: v for key, v in group.items() if key != "params"}, "params": chosen})
        live = inner.param_groups
        inner.state.update(self._loose)
        try:
            inner.param_groups = groups
            step_unhooked(inner)
        finally:
            inner.param_groups = live
            after = {(p, k): inner.state.pop(targets[(p, k)], None) for _, p, k in tile}
            self._loose = dict(inner.state)
            inner.state.clear()
        if not self.elementwise:  # stepped whole: what it wrote to its groups is theirs
            for group, copy in zip(live, groups):
                group.update({key: v for key, v in copy.items() if key != "params"})
        for _, p, k in tile:  # a chunked gradient is let go after its last chunk (it may be a copy)
            if p in self._records and k == self._records[p].pieces - 1:
                self._flat_grads.pop(p, None)
        return self._keep(tile, lease, targets, after)

    def _keep(self, tile: list[Piece], lease: Lease | None,
              targets: dict[tuple[torch.Tensor, int], torch.Tensor],
              after: dict[tuple[torch.Tensor, int], Any]) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Put what the step left (parameters, masters, state) where it lives; the state that fits no
        record, to be stored after the write-back."""
        fresh: list[tuple[torch.Tensor, dict[str, Any]]] = []
        devices = set()
        for _, p, k in tile:
            target, state = targets[(p, k)], after[(p, k)]
            rec = self._records.get(p)
            if self.master_weights:
                target.grad = None
                lo, hi = rec.span(k) if rec is not None else (0, p.numel())
                here = self._lent.get(p, p).detach()
                (here if rec is None or not rec.chunk else here.view(-1)[lo:hi]).copy_(target)
                # Stored even when the optimizer keeps no state (SGD without momentum): the master is what
                # makes the next step fp32 arithmetic rather than the 16-bit parameter's.
                state = {**(state or {}), MASTER: target}
            elif rec is not None and rec.chunk:
                target.grad = None
            if state is None:
                continue
            check_values(type(self.optimizer).__name__, self._name(p), state)
            if rec is None or not rec.fits(k, state):
                if rec is not None and rec.chunk:
                    now = [(key, v.dtype) for key, v in state.items() if is_swapped(key, v)]
                    raise RuntimeError(f"the state of {self._name(p)}, stepped in chunks, changed from "
                                       f"{[(e.key, e.dtype) for e in rec.entries]} to {now}")
                if rec is not None and p in self._made:  # tensors may be views of the lease, soon reused
                    state = {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in state.items()}
                fresh.append((p, state))  # new, or another shape than before: laid out anew
                continue
            views = rec.tensors(lease, k)  # type: ignore[arg-type]
            moved = {key: state[key] for key, view in views.items()
                     if state[key].data_ptr() != view.data_ptr()}
            if any(in_lease(v, lease) for v in moved.values()):  # e.g. two buffers swapped: read all first
                moved = {key: v.clone() if in_lease(v, lease) else v for key, v in moved.items()}
            for key, v in moved.items():
                views[key].copy_(v, non_blocking=True)
                devices.add(v.device)
            rec.scalars = {key: v for key, v in state.items() if not is_swapped(key, v)}
            rec.made = True
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)  # the copies back land before the write-back reads the pool
        return fresh

    def _stage(self, views: dict[str, torch.Tensor], p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state for stepping `p`: the pool's views for a host parameter, copies on `p`'s device else."""
        if p.device.type == "cpu" and not self._STAGE_ON_HOST:
            return views
        return {key: v.to(p.device, non_blocking=True, copy=True) for key, v in views.items()}

    def _store_fresh(self, fresh: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Lay out state made in memory (a first step, or state whose layout changed) as new units and
        write it; the units of a layout it replaces are given back."""
        for p, state in fresh:
            if p in self._records:
                self._drop(p)
            rec = self._reserve(p, entries_of(state))
            rec.scalars = {key: v for key, v in state.items() if not is_swapped(key, v)}
            self._write_record(rec, state)

    def _write_record(self, rec: Record, state: dict[str, Any],
                      drop: Callable[[Any], None] | None = None) -> None:
        """Write `state`'s swapped tensors (whole, in memory or memory-mapped) into `rec`'s units, a piece
        at a time through the pool; `drop(tensor)` after each tensor's last piece (pages given back)."""
        for k in range(rec.pieces):
            lo, hi = rec.span(k)
            lease = self.swap.allocate(rec.units[k])
            try:
                for key, view in rec.tensors(lease, k).items():  # type: ignore[arg-type]
                    src = state[key] if not rec.chunk else state[key].reshape(-1)[lo:hi]
                    view.copy_(src)
                    if drop is not None:  # this piece's pages: memory stays within a piece of the file
                        drop(src)
            except BaseException:
                lease.release()  # type: ignore[union-attr]
                raise
            lease.write_back()  # type: ignore[union-attr]

    def _outline(self, only: list[torch.Tensor] | None = None) -> None:
        """Make `state` show, per parameter (of `only`, when given), its small state and a meta tensor for
        each swapped one."""
        def outline(rec: Record) -> dict[str, Any]:
            return {**rec.scalars, **{e.key: torch.empty(e.shape, dtype=e.dtype, device="meta")
                                      for e in rec.entries}}

        # Units reserved for state the optimizer has not made (yet) are not state.
        if only is not None:
            self.state.update({p: outline(self._records[p]) for p in only if self._records[p].made})
            return
        self.state = defaultdict(dict, {p: outline(rec) for p, rec in self._records.items() if rec.made})

    # -------------------------------------------------------------------------------------------- life
    def _name(self, p: torch.Tensor) -> str:
        for gi, g in enumerate(self.optimizer.param_groups):
            for i, q in enumerate(g["params"]):
                if q is p:
                    return f"parameter {i} of group {gi}"
        return "a parameter"

    def _check_param(self, p: torch.Tensor, name: str) -> None:
        if getattr(p, HIDDEN_ATTR, None) is not None:
            raise ValueError(f"{name} was offloaded by offload_parameters after the optimizer was given it: "
                             "make the optimizer on model.parameters() after offload_parameters(model)")
        if p.device.type not in DEVICES:
            raise ValueError(f"{name} is on {p.device}: OffloadedOptimizer steps parameters on the host or a "
                             "CUDA GPU")
        if self.master_weights and not p.is_floating_point():
            raise ValueError(f"{name} is {p.dtype}: master weights need floating-point parameters")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this OffloadedOptimizer is closed (its state files are gone); make a new one "
                               "and load() a checkpoint")

    def _check_usable(self) -> None:
        self._check_open()
        self._drop_backward_prefetch()  # before anything takes pool memory
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
        self._backward_steps_end()
        self.swap.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an OffloadedOptimizer holds files and locked memory: it cannot be pickled or "
                        "copied; save() its state and load() it into a new one")

    def __repr__(self) -> str:
        return (f"OffloadedOptimizer({type(self.optimizer).__name__}, {self.swap.directory!r}, "
                f"budget_bytes={self.budget_bytes}, master_weights={self.master_weights})")


def _copied(values: dict[str, Any]) -> dict[str, Any]:
    """Each chunk of a parameter starts from the step's small values, not another chunk's updated ones."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
