"""offload_shards: the shards of a model sharded by torch's FSDP2 (`fully_shard`) kept on the drive
between uses, each rank its own.

FSDP2 gives each rank a shard of every parameter and gathers a unit's shards (a module given to
`fully_shard`) just before the unit's forward and again before its backward, reducing its gradients to
shards after the backward. Offloaded, a unit's parameter shards and gradient shards live in this rank's swap
space (its own folder) and are in memory only around those moments: read (ahead, in the order the last
forward ran the units, backward in reverse) before FSDP gathers them, given back after the unit's forward,
and, with its gradients written, after its backward. OffloadedOptimizer steps them a unit at a time
(ShardLending), its own state on the drive beside them.

Only FSDP2's public faces are used: forward pre- and post-hooks on the unit modules, put before FSDP's own
(`prepend=True`), so that the shards are in memory when FSDP reads them; hooks on the unit's output tensors,
registered before FSDP registers its own, so that a unit's shards are back before FSDP gathers them for its
backward (and, as FSDP's backward prefetch gathers the unit that ran before it, that one's too); an identity
autograd function on the unit's inputs, applied before FSDP applies its own, whose backward therefore runs
once FSDP has reduced the unit's gradients; a callback at the end of the backward (the root's gradients are
reduced in FSDP's own such callback). The shards' tensors are FSDP's own, never replaced: what is given
back is their memory (shard_parts.py), which shows the bytes on the drive meanwhile, so code that reads or
writes a shard between uses gets what it would get in memory.

A unit's parameters are written only when they changed (by the optimizer's step, or through the mapping):
a forward reads them and writes nothing. Gradients are written after each backward of their unit (with
gradient accumulation, read back before the next one adds to them), unless the optimizer steps the unit
in its backward (shard_backward_step.py): then they are dropped, and the stepped shards written.

Every hook runs under rank_errors.agree: a rank's failure in one (a read's EIO, a write's full disk) is
raised on every rank of the model's mesh there, instead of leaving the others in FSDP's next collective.

Threads: one thread trains the model (as FSDP2 requires). fork(): the child cannot use the shards (the swap
space's I/O threads stay in the parent); make the model anew there.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from deepnvme.offload._doors import SWAP
from deepnvme.offload.swap import (
    Closing,
    Lease,
    SwapSpace,
    budget_arg,
    check_memory_room,
    directory_arg,
    return_freed_memory,
    round_up,
)
from deepnvme.offload.train.dtensors import is_dtensor
from deepnvme.offload.train.model_io import Checkpoint
from deepnvme.offload.train.rank_errors import agree, group_of
from deepnvme.offload.train.shard_bystanders import Bystander
from deepnvme.offload.train.shard_fill import fill_unit
from deepnvme.offload.train.shard_parts import CAN_MAP, Parts, storages_of
from deepnvme.offload.train.shard_units import ShardUnit, check_buffers, fsdp_groups, plan_units, shard_bytes
from deepnvme.offload.train.unit_hooks import BackwardEnds, through


class OffloadedShards(Closing):
    """This rank's shards of an FSDP2 model on the drive (see the module docstring and offload_shards)."""

    def __init__(self, model: nn.Module, directory: str | os.PathLike, budget_bytes: int, *,
                 prefetch: int = 1, checkpoint: str | os.PathLike | None = None) -> None:
        self._closed = True
        first = next((p for _, _, ps in fsdp_groups(model) for p in ps if is_dtensor(p)), None)
        self.group = None if first is None else group_of(first)  # the ranks that hear of a failure here
        try:
            agree(lambda: self._start(model, directory, budget_bytes, prefetch, checkpoint), self.group)
        except BaseException:
            if not self._closed:  # another rank failed: this one's shards go back into memory too
                try:
                    self.close()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise

    def _start(self, model: nn.Module, directory: str | os.PathLike, budget_bytes: int, prefetch: int,
               checkpoint: str | os.PathLike | None) -> None:
        if not CAN_MAP:
            raise RuntimeError(f"torch {torch.__version__} cannot point a storage at other memory "
                               "(UntypedStorage._swap_data_ptr_): shards cannot be offloaded with it")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (units read ahead), got {prefetch!r}")
        directory_arg(directory)
        budget = budget_arg(budget_bytes)
        plans = plan_units(model)
        meta = [name for name, _, ps in plans if any(p.is_meta for p in ps)]
        if meta and checkpoint is None:
            raise ValueError(f"the shards of {meta[0]} are on the meta device: give checkpoint= (a "
                             "safetensors file or folder, deepnvme's store, or a file in torch's format) to "
                             "fill them from, a unit at a time")
        if checkpoint is not None:
            check_buffers(model)
        sizes = [sum(round_up(shard_bytes(p)) for p in ps) for _, _, ps in plans]
        largest = 2 * max(sizes)  # a unit's parameter shards, and as much in gradients
        self.min_budget_bytes = (3 + prefetch) * largest
        if budget < self.min_budget_bytes:
            raise ValueError(f"budget_bytes={budget} is less than offload_shards needs: "
                             f"{self.min_budget_bytes} bytes ({3 + prefetch} x {largest}, the largest unit's "
                             f"shards and gradients; prefetch={prefetch}); raise budget_bytes to at least "
                             f"{self.min_budget_bytes}")
        # What a step holds beyond the pool: FSDP's gathered parameters of a unit and of the one it gathers
        # ahead, and a unit's unsharded gradients (activations are the model's own, not counted); the
        # shards in memory now are given back by this call.
        gathered = max(sum(p.numel() * p.element_size() for p in ps) for _, _, ps in plans)
        self.gathered_bytes = gathered  # the largest unit's parameters, gathered whole
        self.memory_bytes = budget + 3 * gathered
        freed = sum(n for n, (_, _, ps) in zip(sizes, plans) if not any(p.is_meta for p in ps))
        check_memory_room(self.memory_bytes - freed,
                          f"offload_shards(budget_bytes={budget}) with a step's gathered units "
                          f"(3 x {gathered} bytes)")
        return_freed_memory()
        self.prefetch = prefetch
        self.space = SwapSpace(directory, budget, expected_bytes=2 * sum(sizes), requests_in_flight=2,
                               handle_settings=SWAP)
        self._closed = False
        self.fd = -1
        self.units: list[ShardUnit] = []
        self.order: list[ShardUnit] = []  # the units in the order the last forward ended them (FSDP's)
        self.starts: list[ShardUnit] = []  # ... and began them
        self._pass: list[ShardUnit] = []
        self._starts_now: list[ShardUnit] = []
        self._pending: list[tuple[Parts, Lease]] = []  # written, to be mapped once the write is done
        self._busy: set[int] = set()  # ids of the parts brought for a use not yet over
        self._task = -1  # the backward whose end is queued
        self.counts = {"unit_reads": 0, "bytes_read": 0, "bytes_written": 0, "read_from_mapping": 0}
        self.refused: str | None = None  # why forwards are refused (refuse_use)
        self._stepper: Any = None  # a weak reference to the ShardStepper of an optimizer (step_in_backward)
        self.bystanders: list[Bystander] = []  # units with no element here, whose hooks only agree
        try:
            self.fd = os.open(self.space.file, os.O_RDWR)  # type: ignore[arg-type] - the mappings' file
            self._take_units(model, plans, checkpoint)
        except BaseException:
            try:  # the model as it was: shards written so far are read back
                self.close()
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
            raise

    def _take_units(self, model: nn.Module, plans: list[tuple[str, nn.Module, list[nn.Parameter]]],
                    checkpoint: str | os.PathLike | None) -> None:
        """Write every unit's shards (made from `checkpoint` first where they are meta, a unit at a time,
        each given back before the next is made), then hook the units."""
        ckpt = None if checkpoint is None else Checkpoint(checkpoint, self.space)
        try:
            for name, module, params in plans:
                if ckpt is not None and any(p.is_meta for p in params):
                    params = fill_unit(model, params, ckpt)
                    self._drain(block=True)  # the units made before give their memory back first
                u = ShardUnit(len(self.units), name, module, params)
                self.units.append(u)
                u.owner = self
                u.data_unit = u.data.place(self.space, None)
                self._release(u.data, u)
            self._drain(block=True)
        finally:
            if ckpt is not None:
                ckpt.close()
        for u in self.units:
            u.claim()
            self._hook(u)
        held = {id(u.module) for u in self.units}
        if self.group is not None:
            self.bystanders = [Bystander(m, self.group) for _, m, _ in fsdp_groups(model)
                               if id(m) not in held]

    # ------------------------------------------------------------------------------------------ hooks
    # Every rank runs these hooks at the same points, so each can be agreed on (module docstring).
    def _hook(self, u: ShardUnit) -> None:
        def pre(_mod: nn.Module, args: Any, kwargs: Any) -> Any:
            return agree(lambda: self._pre_forward(u, args, kwargs), self.group)

        def post(_mod: nn.Module, _args: Any, output: Any) -> Any:
            return agree(lambda: self._post_forward(u, output), self.group)

        # Registered after fully_shard's, put before them: the shards are in memory when FSDP gathers them.
        u.handles.append(u.module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
        u.handles.append(u.module.register_forward_hook(post, prepend=True))

    def _pre_forward(self, u: ShardUnit, args: Any, kwargs: Any) -> Any:
        self._check_open()
        if self.refused is not None:
            raise RuntimeError(f"{self.refused}: the shards are a mix of old and loaded units; load a "
                               "checkpoint again before using the model")
        self._drain(block=False)
        if self._task != -1 and torch._C._current_graph_task_id() == -1:
            self._backward_over()
        if u.in_backward != -1:  # recomputed in its backward (activation checkpointing): in memory already
            self._bring(u, grads=True)
            return args, kwargs
        if u is self.units[0] or u in self._starts_now:  # a new forward
            if len(self._starts_now) == len(self.units):
                self.starts = self._starts_now
            self._pass, self._starts_now = [], []
        self._starts_now.append(u)
        self._bring(u, grads=False)
        ahead = self._after(u, self.starts)
        self._read_ahead(ahead[:self.prefetch], grads=False)
        if torch.is_grad_enabled():  # the unit's inputs: their gradients are complete after FSDP's reduction
            def ends() -> None:
                self._agreed_in_backward(lambda: self._backward_ends(u))

            args, kwargs = through(BackwardEnds, ends, (args, kwargs))
        return args, kwargs

    def _post_forward(self, u: ShardUnit, output: Any) -> Any:
        if u.in_backward != -1:
            return output
        if u not in self._pass:
            self._pass.append(u)
            if len(self._pass) == len(self.units) or u is self.units[0]:
                self.order = list(self._pass)
        needs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if needs:
            fired = [-1]

            def begins(grad: torch.Tensor) -> torch.Tensor:
                task = torch._C._current_graph_task_id()
                if fired[0] != task:
                    fired[0] = task
                    if self.stepper is not None:
                        self.stepper.check(u)
                    self._agreed_in_backward(lambda: self._backward_begins(u, task))
                return grad

            for t in {id(t): t for t in needs}.values():
                t.register_hook(begins)
        self._follow(u)
        self._release(u.data, u)
        return output

    @property
    def stepper(self) -> Any:
        """The ShardStepper of the optimizer that steps the units in their backward (None: none does)."""
        return self._stepper() if self._stepper is not None else None

    @stepper.setter
    def stepper(self, stepper: Any) -> None:
        self._stepper = weakref.ref(stepper) if stepper is not None else None

    def _backward_begins(self, u: ShardUnit, task: int) -> None:
        stepper = self.stepper
        if self._task != task:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._ended_soon)
        u.in_backward = task
        self._drain(block=False)
        self._bring(u, grads=True)
        back = self._after(u, self.order[::-1])
        if back:  # FSDP's backward prefetch gathers the unit that ran before this one
            self._bring(back[0], grads=False)
        self._read_ahead(back[:1 + self.prefetch], grads=True)
        if stepper is not None:  # its optimizer state read while its backward computes
            stepper.prefetch(u)

    def _backward_ends(self, u: ShardUnit) -> None:
        if u.in_backward == -1:
            return
        u.in_backward = -1
        stepper = self.stepper
        if stepper is not None and stepper.step(u):  # stepped: its gradients dropped, its shards written
            u.data.dirty = True
        self._take_grads(u)
        if u.grads is not None:
            self._release(u.grads, u)
        self._follow(u)
        self._release(u.data, u)

    def _ended_soon(self) -> None:
        # Queued at the backward's first unit, so before FSDP queues the callback that reduces the root's
        # gradients: queued again from here, it runs after that one.
        torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def _ended(self) -> None:
        def end() -> None:
            for u in self.units:  # units whose inputs needed no gradient (the root's): no identity ran
                self._backward_ends(u)
            self._backward_over()

        self._agreed_in_backward(end)

    def _agreed_in_backward(self, run: Any) -> None:
        """`run` (a part of the backward) agreed on by the ranks; when it failed on any, the optimizer
        stepping the units in the backward refuses to step until a load (stepper.failed)."""
        try:
            agree(run, self.group)
        except BaseException:
            stepper = self.stepper
            if stepper is not None:
                stepper.failed()
            raise

    def _backward_over(self) -> None:
        """The backward is over: ended, or (a forward outside any backward while one is begun and not
        ended) raised part way, on every rank as its hooks are agreed on. No unit is in one now (a unit
        left in it would take the next forward for a recompute and skip its hooks)."""
        for u in self.units:
            u.in_backward = -1
        for b in self.bystanders:
            b.in_backward = -1
        self._task = -1
        self.settle()

    def settle(self) -> None:
        """Between passes: units still brought (FSDP's backward prefetch of a frozen unit, a forward
        that raised) are given back, reads issued ahead and not taken are dropped (their memory held for
        good otherwise), and every write is waited for."""
        for u in self.units:
            if u.in_backward == -1 and id(u.data) in self._busy:
                self._follow(u)
                self._release(u.data, u)
            if u.in_backward == -1 and u.grads is not None and id(u.grads) in self._busy:
                self._release(u.grads, u)
        self._drop_read_aheads()
        self._drain(block=True)

    def _drop_read_aheads(self) -> None:
        for u in self.units:
            for parts in (u.data, u.grads):
                if parts is not None:
                    parts.drop_reading()

    # ----------------------------------------------------------------------------------------- moves
    @staticmethod
    def _after(u: ShardUnit, order: Sequence[ShardUnit]) -> list[ShardUnit]:
        for i, x in enumerate(order):
            if x is u:
                return list(order[i + 1:])
        return []

    def _take_grads(self, u: ShardUnit) -> None:
        """Follow the gradients FSDP left (new storages after they were set to None)."""
        now = storages_of(u.local_grads())
        have = u.grads
        if have is not None and [st._cdata for st in have.storages] == [st._cdata for st in now]:
            have.dirty = True  # accumulated into, or made anew in the same memory
            return
        if have is not None:
            self._let_go(have)
        u.grads = None
        if now:
            u.grads = Parts(f"grads.{u.index}", now)
            u.grad_unit = u.grads.place(self.space, u.grad_unit)

    def _follow(self, u: ShardUnit) -> None:
        """Follow FSDP when it gave a shard other memory (its lazy initialisation pads an uneven shard anew,
        a conversion or load_state_dict(assign=True) replaces it): the new storages, which hold the values,
        become the unit's parts."""
        now = storages_of(p.to_local() for p in u.params)
        if [st._cdata for st in now] == [st._cdata for st in u.data.storages]:
            return
        old = u.data
        self._let_go(old)
        u.data = Parts(old.name, now)
        u.data_unit = u.data.place(self.space, u.data_unit)

    def _let_go(self, parts: Parts) -> None:
        """Forget `parts` (their range of the swap file is reused next). A storage someone still holds (a
        gradient kept after zero_grad) that shows the mapping is given its values in memory first: the
        mapping would show the bytes written there next."""
        if not parts.resident and parts.shared():
            self.space.check_files()
            self._fill_checked(parts, parts.reading)
            parts.reading = None
        parts.forget()
        self._busy.discard(id(parts))

    def _read_ahead(self, units: Sequence[ShardUnit], grads: bool) -> None:
        for u in units:
            for parts in (u.data, u.grads if grads else None):
                if parts is None or parts.resident or parts.reading is not None:
                    continue
                parts.reading = self.space.read([parts.unit], block=False)  # type: ignore[list-item]
                if parts.reading is None:
                    return  # the pool is full: the rest are read when wanted

    def _bring(self, u: ShardUnit, grads: bool) -> None:
        """Make `u`'s parameter shards (and its gradients with `grads`) resident."""
        self._follow(u)
        for parts in (u.data, u.grads if grads else None):
            if parts is None:
                continue
            if grads and parts is u.grads and not u.local_grads():
                self._let_go(parts)  # set to None since: nothing to bring
                u.grads = None
                continue
            self._busy.add(id(parts))
            lease, parts.reading = parts.reading, None
            if parts.resident:
                if lease is not None:
                    lease.release()
                if parts.stamp is None:
                    parts.stamp = _versions(u.tensors(parts))
                continue
            # A file cut short would make the mapping's pages unreadable (SIGBUS): an OSError naming it.
            self.space.check_files()
            self._fill_checked(parts, lease)
            parts.stamp = _versions(u.tensors(parts))

    def _fill_checked(self, parts: Parts, lease: Lease | None) -> None:
        """Make `parts` resident from a read of its unit (`lease`, issued ahead, or issued now), whose bytes
        are checked against their CRC-32. Where code wrote through the mapping (a gradient clipped in place)
        its pages hold the values and are taken instead, but the read still checks the drive's bytes: the
        pages it did not write show the file's, which may have changed."""
        written = parts.written()
        if lease is None:
            lease = self.space.read([parts.unit], demand=True, block=False)  # type: ignore[list-item]
        if lease is None:  # the pool holds reads issued ahead, which only this thread takes: dropped
            self._drop_read_aheads()
            lease = self.space.read([parts.unit], demand=True)  # type: ignore[list-item]
        lease.demand()
        try:
            lease.wait()
            parts.fill(None if written else lease)
        finally:
            lease.release()
        self.counts["unit_reads"] += 1
        self.counts["bytes_read"] += parts.nbytes
        if written:
            self.counts["read_from_mapping"] += parts.nbytes

    def _release(self, parts: Parts, u: ShardUnit) -> None:
        """Give `parts`' memory back: at once if the drive holds its values, else once they are written
        (a write in flight maps them when done: mapped before, the page cache could hold older bytes).
        Tensors written in place since they were brought (their versions moved) are written."""
        self._busy.discard(id(parts))
        if parts.resident and parts.stamp is not None and parts.stamp != _versions(u.tensors(parts)):
            parts.dirty = True
        parts.stamp = None
        if any(p is parts for p, _ in self._pending):
            return
        if parts.resident and not parts.dirty:
            parts.map(self.fd)
        elif parts.resident:
            self._pending.append((parts, parts.write(self.space, self._drop_read_aheads)))
            self.counts["bytes_written"] += parts.nbytes

    def _drain(self, block: bool) -> None:
        """Map the parts whose writes are done (all of them, waiting, with `block`); raise a write's error
        (its parts stay in memory, to be written again at their next release)."""
        keep, failed = [], None
        for parts, lease in self._pending:
            if not block and not lease.done():
                keep.append((parts, lease))
                continue
            try:
                lease.wait()
            except OSError as exc:
                parts.dirty = True
                failed = failed or exc
                continue
            if parts.storages and not parts.dirty and id(parts) not in self._busy:  # written, unchanged
                parts.map(self.fd)
        self._pending = keep
        if failed is not None:
            raise failed

    def release_stepped(self, u: ShardUnit) -> None:
        """After the optimizer stepped `u`: its parameters are written, its gradients given back."""
        self._follow(u)
        u.data.dirty = True
        self._release(u.data, u)
        if u.grads is not None:
            self._release(u.grads, u)

    def copies(self, u: ShardUnit) -> list[torch.Tensor]:
        """`u`'s parameter shards as fresh memory of their own, read (checked) from the drive when given
        back; for checkpoint writers, which may hold them past the unit's next use."""
        return self._in_memory(u, lambda: [p.to_local().clone() for p in u.params])

    def assign(self, u: ShardUnit, values: Sequence[torch.Tensor]) -> None:
        """Copy `values` (one per parameter of `u`, shaped like its local shard) into `u`'s shards, which
        are then written; for checkpoint loaders, a unit at a time."""
        if len(values) != len(u.params):
            raise ValueError(f"{u.name}: {len(values)} values for {len(u.params)} parameters")
        self._in_memory(u, lambda: [p.to_local().copy_(v) for p, v in zip(u.params, values)])

    @torch.no_grad()
    def _in_memory(self, u: ShardUnit, run: Any) -> Any:
        self._check_open()
        self._drain(block=False)
        held = id(u.data) in self._busy
        self._bring(u, grads=False)
        try:
            return run()
        finally:
            if not held:
                self._follow(u)
                self._release(u.data, u)

    # ------------------------------------------------------------------------------------------- life
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("these shards were closed (OffloadedShards.close()): the model's shards are "
                               "back in memory and no longer offloaded")

    def refuse_use(self, reason: str | None) -> None:
        """Refuse forwards, saying `reason`, until called with None (a load that failed half way leaves the
        shards a mix of old and loaded units)."""
        self.refused = reason

    def stats(self) -> dict[str, Any]:
        """What moved so far: unit reads, bytes read and written, bytes taken from mappings."""
        return {**self.counts, "units": len(self.units), "swap_bytes": self.space.reserved_bytes}

    @property
    def budget_bytes(self) -> int:
        return self.space.pool.capacity  # type: ignore[union-attr]

    def close(self, restore: bool = True) -> None:
        """Put every shard (and gradient) back in memory (`restore`), remove the hooks and the swap files.
        With restore=False (or once a read back has failed: that error is raised) the shards left on the
        drive keep showing their mappings of the removed file: readable, and never written back."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            try:
                self._drain(block=True)
            except BaseException as exc:  # noqa: BLE001 - raised below, after everything is let go
                errors.append(exc)
            for b in self.bystanders:
                b.remove()
            for u in self.units:
                for h in u.handles:
                    h.remove()
                u.handles = []
                u.unclaim()
                if restore and not errors:
                    try:
                        self._bring(u, grads=True)
                    except BaseException as exc:  # noqa: BLE001 - raised below
                        errors.append(exc)
                for parts in (u.data, u.grads):
                    if parts is not None:
                        parts.drop_reading()
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.space.close()
        if errors:
            raise errors[0]


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    return [t._version for t in tensors]


def offload_shards(model: nn.Module, directory: str | os.PathLike, budget_bytes: int = 256 << 20, *,
                   prefetch: int = 1, checkpoint: str | os.PathLike | None = None) -> OffloadedShards:
    """Keep this rank's shards of `model` (sharded by torch's `fully_shard`: on each block, then on the
    model) in a swap space under `directory` (this process's own folder in it), reading each unit's shards
    just before FSDP gathers them and giving them back after (see the module docstring). `budget_bytes` of
    locked memory carry every read and write; `prefetch` units are read ahead. Step the model with
    `OffloadedOptimizer(torch.optim.AdamW(model.parameters(), ...), ...)`, made after this call. Returns
    the OffloadedShards (a context manager: close() puts the shards back in memory and removes the files).

    A model built on the meta device (its buffers real: accelerate's `init_empty_weights`) and sharded is
    filled from `checkpoint` (a safetensors file or folder, deepnvme's store, or a file in torch's format
    such as `deepnvme.save` writes) a unit at a time, each rank reading only its rows (shard_fill.py).
    """
    return OffloadedShards(model, directory, budget_bytes, prefetch=prefetch, checkpoint=checkpoint)


__all__ = ["OffloadedShards", "offload_shards"]
