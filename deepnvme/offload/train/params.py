"""offload_parameters: a model's parameters and gradients on the drive between uses (ZeRO-Infinity's
parameter offload, for plain PyTorch modules).

Each unit (by default one block of the model's repeated blocks; any modules named) keeps its parameters
in a swap space. A unit's parameters are read just before its forward and freed after it; read again,
with the gradients accumulated so far, just before its backward (the reverse order), and once its
backward is done its gradients are written to the drive and everything is freed; units are read ahead in
the direction of the pass, as far as the budget of locked memory allows. `OffloadedOptimizer`, made on
`model.parameters()` after this, reads each unit's parameters and gradients once a step, beside its
state, and writes the parameters back. Parameters outside every unit, or shared between a unit and
anything else (tied embeddings), stay in memory as they are.

Why the order of events is right (the CPU autograd engine; unit_hooks.py): a pre-hook on the node that
made a unit's outputs runs before any node of the unit (they all need those outputs' gradients) and reads
the unit; a pre-hook on the node that made its inputs runs after every node of the unit (the engine runs
the ready node with the highest sequence number first, and that node was made before any of them) and
finishes it. Leaves have no such node: they pass through identity autograd functions instead. A unit
whose inputs need no gradient (the first) is finished when the whole backward ends (a callback queued on
the engine). See held.py for what the model shows.

Threads: one thread trains (forward, backward, step); others may run forwards without autograd on the
same model at the same time (an evaluation); a unit's state changes under one lock, a unit in use by any
thread is not freed under it, and a step waits for other threads' forwards to leave the model (`idle`).
Two threads training at once are not supported. fork(): a child cannot use the parent's swap space and
says so (RuntimeError); its close() only marks the object closed.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from deepnvme.offload._doors import SWAP
from deepnvme.offload.model import unit_modules
from deepnvme.offload.stores import StoreError
from deepnvme.offload.swap import (
    Closing,
    Lease,
    SwapSpace,
    Ticket,
    Unit,
    budget_arg,
    check_memory_room,
    directory_arg,
    return_freed_memory,
    round_up,
)
from deepnvme.offload.train.held import (
    GRAD_APPLIED,
    GRAD_ON_DRIVE,
    HIDDEN_ATTR,
    NO_GRAD,
    OWNER_ATTR,
    Applied,
    Held,
    HeldUnit,
    OnDrive,
    OneLender,
)
from deepnvme.offload.train.model_io import Checkpoint, converted, fill_residents
from deepnvme.offload.train.model_io import save as save_model
from deepnvme.offload.train.model_methods import ModelMethods
from deepnvme.offload.train.unit_hooks import unwrap_unit, wrap_unit
from deepnvme.offload.train.unit_plan import check_param, dense_grads, memory_need, plan_units

# Units read ahead of the one in use, in the direction of the pass (as far as the budget allows).
DEFAULT_AHEAD = 2
REQUESTS_IN_FLIGHT = 2


class OffloadedParameters(Closing):
    """What offload_parameters returns: the model's offloaded parameters, their swap space, counts."""

    def __init__(self, model: nn.Module, directory: str | os.PathLike, budget_bytes: int, *,
                 units: Any = None, ahead: int = DEFAULT_AHEAD,
                 checkpoint: str | os.PathLike | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if getattr(model, OWNER_ATTR, None) is not None:
            raise ValueError("this model's parameters are offloaded already (close() that first)")
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead must be an int >= 0 (units read ahead), got {ahead!r}")
        directory_arg(directory)
        budget = budget_arg(budget_bytes)
        self._closed = True
        self.model, self.ahead, self.pid = model, ahead, os.getpid()
        chosen = unit_modules(model, units)
        plan = plan_units(model, chosen, meta_ok=checkpoint is not None)
        if checkpoint is None:
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                check_param(name, t, meta_ok=False) if t.is_meta else None
        need = max((sum(round_up(h.numel() * h.element_size()) * (2 if h.requires_grad else 1)
                        for _, h in ps) for ps in plan), default=0)
        if need > budget:
            raise ValueError(f"budget_bytes={budget} cannot hold the largest unit's parameters and gradients "
                             f"({need} bytes): raise budget_bytes to at least {need}, or make smaller units")
        drive = sum(round_up(h.numel() * h.element_size()) * (2 if h.requires_grad else 1)
                    for ps in plan for _, h in ps)
        self.step_bytes = memory_need(model, plan)  # what a training step takes beyond the pool
        self.memory_bytes = budget + self.step_bytes
        check_memory_room(self.memory_bytes, f"offload_parameters(budget_bytes={budget})")
        return_freed_memory()
        self.space = SwapSpace(directory, budget, expected_bytes=drive, requests_in_flight=REQUESTS_IN_FLIGHT,
                               handle_settings=SWAP)
        self._closed = False
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)  # notified as units are freed (a step waits for it)
        self.units: list[HeldUnit] = []
        self.held_by_stand: dict[int, Held] = {}
        self._pending: dict[tuple[int, bool], Lease] = {}
        self._writing: dict[str, list[Ticket]] = {}
        self.callback_queued = False
        self.backward_thread: int | None = None
        self.lender = OneLender()
        self._stepper: Any = None  # a weak reference to the BackwardStepper of an optimizer
        self._methods: ModelMethods | None = None
        self.counts = {"unit_reads": 0, "bytes_read": 0, "bytes_written": 0, "prefetched": 0, "demanded": 0,
                       "lent": 0, "kept": 0}
        ckpt = None
        try:
            if checkpoint is not None:
                ckpt = Checkpoint(checkpoint, self.space)
                fill_residents(self, ckpt, {id(p) for ps in plan for _, p in ps})
            for i, ((name, mod), params) in enumerate(zip(chosen, plan)):
                self.units.append(self._take(i, name, mod, params, ckpt))
            for u in self.units:
                wrap_unit(self, u)
            self._methods = ModelMethods(self)
        except BaseException:
            self.close()
            raise
        finally:
            if ckpt is not None:
                ckpt.close()
        setattr(model, OWNER_ATTR, self)

    # ------------------------------------------------------------------------------------------ setup
    def _take(self, i: int, name: str, mod: nn.Module, params: list[tuple[str, nn.Parameter]],
              ckpt: Checkpoint | None) -> HeldUnit:
        """Move `params` of unit `name` to the drive (their values from `ckpt` when given); their stand-ins
        take their places."""
        held = []
        device = torch.device("cpu")
        for pname, p in params:
            places = [(m, a) for m in mod.modules() for a, q in m._parameters.items() if q is p]
            stand = OnDrive(pname, name, p.shape, p.dtype, device, p.requires_grad)
            setattr(stand, OWNER_ATTR, self)
            real = p if not p.is_meta else nn.Parameter(torch.empty(0, dtype=p.dtype), p.requires_grad)
            h = Held(pname, real, stand, places, self.space.add(pname, p.numel() * p.element_size()),
                     shape=p.shape)
            h.marker = OnDrive(pname + ".grad", name, p.shape, p.dtype, device)
            h.applied = Applied(pname + ".grad", name, p.shape, p.dtype, device)
            if p.requires_grad:  # its room on the drive taken now: a full disk shows here, not mid-backward
                self._grad_unit(h)
            held.append(h)
            self.held_by_stand[id(stand)] = h
            if ckpt is None:
                continue
            key = ckpt.find(self.model, [pname])
            if key is None:
                if p.is_meta:
                    raise StoreError(f"{pname} is on the meta device and {ckpt.path} does not hold it")
                self._write([h], [p.detach()], [h.data])
                continue
            with ckpt.tensor(key) as v:
                self._write([h], [converted(v, p, pname, ckpt.path)], [h.data])
        u = HeldUnit(i, name, mod, held)
        if held and ckpt is None:
            self._write(held, [h.real.detach() for h in held], [h.data for h in held])
        for h in held:
            if h.real.grad is not None:  # a gradient it had goes to the drive with it
                self._write([h], [h.real.grad], [self._grad_unit(h)])
                h.grad, h.stand.grad = GRAD_ON_DRIVE, h.marker
            h.park_grad()
            setattr(h.real, HIDDEN_ATTR, self)
            h.empty()
            for m, attr in h.places:
                m._parameters[attr] = h.stand
        return u

    def _grad_unit(self, h: Held) -> Unit:
        if h.grad_unit is None:
            h.grad_unit = self.space.add(h.name + ".grad", h.nbytes)
        return h.grad_unit

    # ------------------------------------------------------------------------------------------ I/O
    def _lease(self, units: Sequence[Unit], read: bool, block: bool = True,
               make_room: Callable[[], None] | None = None) -> Lease | None:
        """Pool memory for `units` (read from the drive when `read`): reads ahead are dropped (and
        `make_room()` called: the caller's own) when they are what keeps the pool full, so that a demand
        never waits on them."""
        if read:
            self._settle_writes(units)
        get = (lambda b: self.space.read(units, block=b, demand=True)) if read else (
            lambda b: self.space.allocate(units, b))
        lease = get(False)
        if lease is None and block:
            self._drop_pending()
            if make_room is not None:
                make_room()
            lent = [x for x in self.units if x.lease is not None]  # all this thread's (OneLender)
            if lent and (lease := get(False)) is None:
                for x in lent:  # units in use that show pool memory keep it no longer: copied out
                    x.keep_lent()
                self.counts["kept"] += len(lent)
                self.idle.notify_all()
            if lease is None:
                lease = get(True)
        return lease

    def _settle_writes(self, units: Iterable[Unit]) -> None:
        """Wait for the writes of any of `units` still in flight (a read must see them); raise their error."""
        for u in units:
            for t in self._writing.pop(u.name, []):
                t.settle()
                if t.error is not None:
                    raise t.error

    def _write(self, held: Sequence[Held], sources: Sequence[torch.Tensor], units: Sequence[Unit],
               make_room: Callable[[], None] | None = None) -> None:
        """Copy `sources` into pool memory and queue their writes to `units` (returns once queued)."""
        lease = self._lease(units, read=False, make_room=make_room)  # blocking: never None
        try:
            for src, u in zip(sources, units):
                lease.view(u).copy_(src.detach().reshape(-1).view(torch.uint8))  # type: ignore[union-attr]
        except BaseException:
            lease.release()  # type: ignore[union-attr]
            raise
        self._write_back(lease)  # type: ignore[arg-type]

    def _write_back(self, lease: Lease) -> None:
        """Queue the writes of `lease`'s units from its memory (a read of one of them waits for them)."""
        tickets = lease.write_back()
        self._writing.update((u.name, tickets) for u in lease.units)
        self.counts["bytes_written"] += sum(u.nbytes for u in lease.units)

    def _units_of(self, u: HeldUnit, grads: bool) -> list[Unit]:
        """The units a read of `u` takes: its parameters, and its gradients on the drive when `grads`."""
        out = u.data_units()
        if grads:
            out += [h.grad_unit for h in u.params if h.grad_unit is not None
                    and h.grad_state() == GRAD_ON_DRIVE]
        return out

    def _read(self, u: HeldUnit, grads: bool) -> Lease:
        """The lease of `u`'s parameters (and gradients), read ahead or read now, waited for."""
        lease = self._pending.pop((u.index, grads), None)
        if lease is not None and not set(self._units_of(u, grads)) <= set(lease.units):
            lease.release()  # a gradient reached the drive since it was read ahead
            lease = None
        if lease is None:
            lease = self._lease(self._units_of(u, grads), read=True)
            self.counts["demanded"] += 1
        else:
            lease.demand()  # type: ignore[union-attr]
            self.counts["prefetched"] += 1
        try:
            lease.wait()  # type: ignore[union-attr]
        except BaseException:
            lease.release()  # type: ignore[union-attr]
            raise
        self.counts["unit_reads"] += 1
        self.counts["bytes_read"] += sum(x.nbytes for x in lease.units)  # type: ignore[union-attr]
        return lease  # type: ignore[return-value]

    def prefetch(self, order: Iterable[int], grads: bool) -> None:
        """Read ahead the units at `order` (the next ones of this pass; for a backward, `grads`: with their
        gradients on the drive) while the pool has room. A lease is kept under (unit, whether it holds
        gradients), as _read asks for it."""
        for n, i in enumerate(order):
            if n >= self.ahead:
                return
            u = self.units[i]
            units = self._units_of(u, grads)
            key = (i, len(units) > len(u.params))
            if u.present or key in self._pending or not u.params:
                continue
            if any(not all(t.done() for t in self._writing.get(x.name, [])) for x in units):
                return  # still being written: read it when it is wanted
            self._settle_writes(units)
            lease = self.space.read(units, block=False)
            if lease is None:
                return
            self._pending[key] = lease

    def _drop_pending(self) -> None:
        for lease in self._pending.values():
            lease.release()
        self._pending.clear()

    # ------------------------------------------------------------------------------------------ uses
    def bring(self, u: HeldUnit, grads: bool) -> None:
        """Fill `u`'s parameters from the drive and, for its backward (`grads`), give them the gradients
        accumulated so far."""
        drive = grads and any(h.grad_state() == GRAD_ON_DRIVE and not h.loaded_grad for h in u.params)
        lease = self._read(u, drive) if u.params and (not u.present or drive) else None
        try:
            if not u.present:
                # shown where it was read (no copy), by the one thread that lends: the unit's until free()
                if self.lender.mine() and u.lend(lease):
                    self.counts["lent"] += 1
                else:
                    for h in u.params:
                        h.fill(lease.view(h.data))  # type: ignore[union-attr]
                u.present = True
            if grads:
                for h in u.params:
                    self._load_grad(h, lease)
        finally:
            if lease is not None and lease is not u.lease:
                lease.release()

    def _load_grad(self, h: Held, lease: Lease | None) -> None:
        """Give `real` the gradient accumulated so far, as autograd would find it in memory."""
        if h.real.grad is h.marker:
            h.real.grad = None
        if h.real.grad is None and not h.loaded_grad:
            h.real.grad = h.gradient(lease)
            h.loaded_grad = h.grad == GRAD_ON_DRIVE and h.real.grad is not None

    def settle_interrupted(self) -> None:
        """Outside any backward, units still held are those of a backward that ended by an exception
        (Ctrl-C, an error in a hook): they are finished as its end would have, their gradients so far
        written, as autograd leaves them in memory for a model there. Only the thread that ran that backward
        can see it is over (another thread is outside a backward while it runs)."""
        if (self.callback_queued and self.backward_thread == threading.get_ident()
                and torch._C._current_graph_task_id() == -1):
            self._backward_ended(interrupted=True)

    @property
    def stepper(self) -> Any:
        """The BackwardStepper of the OffloadedOptimizer stepping this model in its backward, or None (held
        weakly: an optimizer dropped without close() is collected and steps nothing)."""
        return self._stepper() if self._stepper is not None else None

    @stepper.setter
    def stepper(self, stepper: Any) -> None:
        self._stepper = weakref.ref(stepper) if stepper is not None else None

    def _follow_requires_grad(self, u: HeldUnit) -> None:
        """Give the tensors autograd uses the requires_grad the caller set on the stand-ins since (unfreezing
        or freezing after the offload); a gradient newly wanted gets its room on the drive now."""
        changed = [h for h in u.params if h.real.requires_grad != h.stand.requires_grad]
        if not changed:
            return
        need = sum(round_up(h.nbytes) * (2 if h.stand.requires_grad else 1) for h in u.params)
        if need > self.budget_bytes:
            raise ValueError(f"unit {u.name!r} now needs {need} bytes of locked memory for its parameters "
                             f"and gradients ({changed[0].name} requires a gradient since the offload), more "
                             f"than budget_bytes={self.budget_bytes}: offload again with a larger budget")
        for h in changed:
            if h.stand.requires_grad:
                self._grad_unit(h)
            h.real.requires_grad_(h.stand.requires_grad)

    def register_hook(self, stand: OnDrive, hook: Callable[[torch.Tensor], Any]) -> Any:
        """`stand.register_hook(hook)`: on the tensor autograd uses for it."""
        with self.lock:
            self._check_open()
            h = self.held_by_stand[id(stand)]
            u = next(x for x in self.units if h in x.params)
            if not (u.depth or u.held):
                self._follow_requires_grad(u)
            return h.real.register_hook(hook)

    def enter(self, u: HeldUnit) -> None:
        """A forward (or a recompute) of `u` begins: its parameters in memory and in its modules."""
        self._check_open()
        self.settle_interrupted()
        self.lender.check(self.units, self.idle)
        if not (u.depth or u.held):
            self._follow_requires_grad(u)
        u.depth += 1
        try:
            self.bring(u, grads=False)
        except BaseException:
            u.depth -= 1
            raise
        if u.depth == 1:
            for h in u.params:
                h.show(True)
        if not u.held:
            self.prefetch(range(u.index + 1, len(self.units)), grads=False)

    def leave(self, u: HeldUnit, grad: bool) -> None:
        """A forward of `u` ended: its stand-ins back in its modules, its memory freed unless its backward
        holds it; after the last unit's forward with autograd on, its backward's read is issued."""
        u.depth -= 1
        # Every forward outside a backward may have one to come: with grad off too (reentrant checkpointing
        # runs the forward without it, and its backward's recompute runs inside the backward).
        if torch._C._current_graph_task_id() == -1:
            u.graphs += 1
        if u.depth or u.held:
            return
        for h in u.params:
            h.show(False)
        self.free(u)
        if grad and u.index == len(self.units) - 1:
            self.prefetch([u.index], grads=True)

    def backward_begins(self, u: HeldUnit) -> None:
        """Before any node of `u`'s backward: its parameters and gradients so far in memory; the units
        before it read ahead."""
        with self.lock:
            self._check_open()
            self.lender.check(self.units, self.idle)
            if not self.callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
                self.callback_queued = True
                self.backward_thread = threading.get_ident()  # only its thread can tell it has ended
            if not u.held:  # shown in its modules too: a recompute may bypass its forward (HF checkpointing)
                applied = [h.name for h in u.params if h.grad_state() == GRAD_APPLIED]
                if applied:  # in memory this backward would add to it: it is gone
                    raise RuntimeError(
                        f"the gradient of {applied[0]} was applied by the optimizer's step in an earlier "
                        "backward and is gone, so this backward cannot add to it: call opt.zero_grad() "
                        "before it, or set opt.step_in_backward = False for the micro-batches before the "
                        "last of an accumulation")
                self.bring(u, grads=True)
                u.held = True
                for h in u.params:
                    h.show(True)
                stepper = self.stepper
                if stepper is not None and u.graphs <= 1:  # its step's state read during its backward
                    stepper.prefetch(u.params)
            self.prefetch(range(u.index - 1, -1, -1), grads=True)

    def backward_ends(self, u: HeldUnit) -> None:
        """After every node of `u`'s backward."""
        with self.lock:
            if u.held:
                self.finish(u)

    def _backward_ended(self, interrupted: bool = False) -> None:
        """The whole backward is done: units it did not finish (no input needed a gradient) are."""
        with self.lock:
            self.callback_queued = False
            for u in self.units:
                if u.held:
                    self.finish(u, interrupted)

    def finish(self, u: HeldUnit, interrupted: bool = False) -> None:
        """`u`'s backward is done: its gradients to the drive (or, stepped in the backward, its parameters),
        its memory freed (unless a forward of it is running)."""
        u.graphs = max(u.graphs - 1, 0)
        done = dense_grads([h for h in u.params if h.real.grad is not None and h.real.grad is not h.marker])
        late = [h for h in done if h.grad_state() == GRAD_ON_DRIVE and not h.loaded_grad]
        stepper = self.stepper
        if done and not (late or interrupted or u.graphs or u.depth) and stepper is not None:
            done = self._step_now(stepper, u, done)
        for h in late:  # a gradient reached after the unit was finished: add it to the one on the drive
            lease = self._read_units([h.grad_unit])  # type: ignore[list-item]
            try:
                old = lease.view(h.grad_unit).view(h.dtype).view(h.shape)  # type: ignore[arg-type]
                h.real.grad = old + h.real.grad
            finally:
                lease.release()
        if done:
            self._write(done, [h.real.grad for h in done], [self._grad_unit(h) for h in done])
        for h in done:
            h.grad, h.stand.grad = GRAD_ON_DRIVE, h.marker
            h.park_grad()
        u.held = False
        for h in u.params:
            h.loaded_grad = False
        if u.depth == 0:
            for h in u.params:
                h.show(False)
            self.free(u)

    def _step_now(self, stepper: Any, u: HeldUnit, done: list[Held]) -> list[Held]:
        """Step `done` (their gradients complete and in memory) with the optimizer stepping in backward and
        write their new values; those it does not step (in none of its groups)."""
        stepped = stepper.step(done)
        if stepped:
            for key in ((u.index, False), (u.index, True)):  # read ahead before the update: stale
                lease = self._pending.pop(key, None)
                if lease is not None:
                    lease.release()
            lent = u.give_lent(stepped)  # written from the pool memory they were computed in: no copy
            if lent is not None:
                self._write_back(lent)
            else:
                self._write(stepped, [h.real.detach() for h in stepped], [h.data for h in stepped])
            for h in stepped:
                h.grad, h.stand.grad, h.real.grad = NO_GRAD, h.applied, None
        return [h for h in done if h not in stepped]

    def free(self, u: HeldUnit) -> None:
        u.empty()
        self.idle.notify_all()

    def _read_units(self, units: list[Unit]) -> Lease:
        lease = self._lease(units, read=True)
        lease.wait()  # type: ignore[union-attr]
        return lease  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------ life
    def _check_open(self) -> None:
        if self._closed and getattr(self, "_dropped", False):
            raise RuntimeError("these offloaded parameters were closed with restore=False: their values were "
                               "dropped with the swap files (load them again with offload_parameters(..., "
                               "checkpoint=) from what save() wrote)")
        if self._closed:
            raise RuntimeError("these offloaded parameters are closed (offload_parameters(...).close() put "
                               "them back in the model)")
        if os.getpid() != self.pid:  # the swap space's I/O threads stayed in the parent: reads would wait
            raise RuntimeError(f"this model's parameters were offloaded by process {self.pid}, before "
                               "fork(): they can be used only there (start workers with the 'spawn' method, "
                               "or offload in the child)")

    @property
    def budget_bytes(self) -> int:
        return self.space.pool.capacity

    def save(self, path: str | os.PathLike) -> None:
        """The model's state_dict at `path` in torch's format (deepnvme.save), offloaded tensors streamed
        from the drive a unit at a time; `offload_parameters(model, ..., checkpoint=path)` reads it back."""
        save_model(self, path)

    def stats(self) -> dict[str, Any]:
        """Counts since offload: unit reads (read ahead or on demand), bytes read and written, units shown
        in the pool memory they were read into (lent: no copy) and those copied out of it for room (kept)."""
        return dict(self.counts)

    def close(self, restore: bool = True) -> None:
        """Put every parameter back in its module with its values (and gradients) from the drive, and remove
        the swap files (idempotent). When the memory cgroup cannot hold them (a model larger than memory),
        MemoryError says so before anything changes; `restore=False` then drops the values with the files
        (save() first to keep them) and leaves the model's stand-ins, which refuse any use. An
        OffloadedParameters collected with its model drops them too (nothing is left to use them)."""
        if getattr(self, "_closed", True):
            return
        if os.getpid() != self.pid:  # a forked child: the parent's I/O threads are not here to wait for
            self._closed = True
            self.space.close()  # in a child it only marks the space closed (SwapSpace.close)
            return
        if restore:
            need = sum(h.nbytes * (2 if h.grad_state() == GRAD_ON_DRIVE else 1) for u in self.units
                       for h in u.params)
            check_memory_room(need, "close() of offload_parameters, putting the parameters back in memory "
                                    "(or save() them and close(restore=False))")
        self._dropped = not restore
        try:
            self._drop_pending()
            for u in self.units:  # the pool is about to go: no window may show it
                u.keep_lent()
            if self._methods is not None:
                self._methods.remove()
            for u in self.units if restore else []:
                unwrap_unit(u)
                if u.params:
                    lease = self._read_units(self._units_of(u, True))
                    try:
                        for h in u.params:
                            h.fill(lease.view(h.data))
                            h.real.data, h.window = h.window.clone(), None  # type: ignore[union-attr]
                            h.real.requires_grad_(h.stand.requires_grad)
                            h.show(True)
                            h.real.grad = None
                            h.real.grad = h.gradient(lease)
                            if getattr(h.real, HIDDEN_ATTR, None) is self:
                                delattr(h.real, HIDDEN_ATTR)
                    finally:
                        lease.release()
        finally:
            self._closed = True
            self.space.close()
            if getattr(self.model, OWNER_ATTR, None) is self:
                delattr(self.model, OWNER_ATTR)

    def __del__(self) -> None:
        try:
            self.close(restore=False)
        except Exception:  # noqa: BLE001 - nothing can be raised from a finaliser
            pass


def offload_parameters(model: nn.Module, directory: str | os.PathLike, budget_bytes: int = 256 << 20, *,
                       units: Any = None, ahead: int = DEFAULT_AHEAD,
                       checkpoint: str | os.PathLike | None = None) -> OffloadedParameters:
    """Keep `model`'s parameters and gradients in files under `directory` (created when missing) between
    uses, moved through `budget_bytes` of locked memory; train it as usual with an OffloadedOptimizer made on
    `model.parameters()` afterwards (see the module docstring). `units` as for stream_weights (default: the
    repeated blocks). `close()` (or the end of a with-block) puts every parameter back in memory with its
    values and gradient.

    `checkpoint` (a safetensors file or folder, deepnvme's store, or a file in torch's format such as
    `save()` writes) gives the values: the model may then be built on the meta device (or with accelerate's
    init_empty_weights) and is filled a tensor at a time, never whole in memory."""
    return OffloadedParameters(model, directory, budget_bytes, units=units, ahead=ahead,
                               checkpoint=checkpoint)
