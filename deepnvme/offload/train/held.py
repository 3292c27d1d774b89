"""One offloaded parameter and one unit of them: what the model shows, what autograd uses, where it lies.

A parameter given to `offload_parameters` is split in two:
- its *stand-in* (`OnDrive`, a Placeholder with the parameter's shape, dtype, device and requires_grad)
  takes its place in the model between uses; it is what `model.parameters()` yields and what an optimizer
  holds, so its identity never changes, and any computation with it raises StreamedWeightError naming it;
- the original Parameter object (`real`) is what autograd sees: it is put back into its module for the
  unit's forward (and a recompute), its storage filled from the drive; between uses the storage is resized
  to nothing, so the tensors autograd saved of it (views of that storage) come back with it when the unit
  is read again for its backward, as FSDP's first version frees its parameters. Filled means shown where
  the unit was read: the storage is pointed at the pool memory (Held.lend, no copy: a copy into new pages
  took about 7% of a step's main thread), and pointed back at its own empty mapping when the unit is freed.
A gradient lies on the drive between backward and step; the stand-in's `.grad` is then an `OnDrive` too
(None when there is none), so `p.grad is not None` means what it means in memory.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepnvme.offload._doors import PAGE, madvise
from deepnvme.offload.model import Placeholder
from deepnvme.offload.swap import Unit, round_up

# The attribute of a stand-in (and of the model) naming the OffloadedParameters it belongs to.
OWNER_ATTR = "_deepnvme_offloaded"
# The attribute of a hidden Parameter (the one autograd uses) naming the OffloadedParameters it belongs to:
# an optimizer made on the model before offload_parameters holds these, and is refused.
HIDDEN_ATTR = "_deepnvme_hidden_by"
# Transparent huge pages: a window this large or larger asks for them (where the kernel's setting is
# "madvise" or "always"; elsewhere the advice is ignored).
HUGE_PAGE = 2 << 20
# Where a parameter's gradient is between uses.
NO_GRAD, GRAD_ON_DRIVE, GRAD_ZERO, GRAD_APPLIED = "none", "drive", "zero", "applied"
# How long a use of the model waits for another thread's to end: a step for forwards in other threads
# (lending.py), a second thread for the units the first one lent to be freed (OneLender).
BUSY_WAIT_S = 60.0
# A window can show pool memory without a copy (Held.lend) where torch can point a storage elsewhere.
LENDING = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and hasattr(
    torch._C, "_construct_storage_from_data_pointer")


class OnDrive(Placeholder):
    """Stands for a parameter (or its gradient) kept on the drive by offload_parameters."""

    @classmethod
    def _explain(cls, name: str, unit: str, func: Any) -> str:
        return (f"{name} lies on the drive (deepnvme.offload.offload_parameters, unit {unit!r}): its values "
                f"exist only while its unit runs forward or backward, and {func} was called outside that. "
                "Step it with deepnvme.offload.OffloadedOptimizer (made after offload_parameters), zero its "
                "gradient with that optimizer's zero_grad(), and read values with save() or close() of "
                "the object offload_parameters returned")

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """Refused: the values are on the drive, where `.data =` cannot reach (it would change only the
        stand-in, silently). Itself is accepted (what Module.to() does for a tensor it does not change)."""
        if value is self:
            return
        raise RuntimeError(f"{self._name}.data = ...: {self._name} lies on the drive (deepnvme.offload."
                           "offload_parameters); give it new values with model.load_state_dict({name: "
                           "tensor}, strict=False), which writes them there, or close() the offload first")

    def register_hook(self, hook: Any) -> Any:  # type: ignore[override]
        """A gradient hook goes on the tensor autograd uses: it sees each gradient as it would in memory."""
        owner = getattr(self, OWNER_ATTR, None)
        if owner is None:
            raise RuntimeError(self._explain(self._name, self._unit, "register_hook"))
        if not self.requires_grad:
            raise RuntimeError(f"cannot register a hook on {self._name}: it does not require a gradient")
        return owner.register_hook(self, hook)

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:  # type: ignore[override]
        """Refused: the hook would be handed the parameter to read its .grad, and an offloaded parameter's
        gradient is in memory only inside its unit's backward."""
        raise RuntimeError(
            f"register_post_accumulate_grad_hook on {self._name}: not available for a parameter offloaded "
            "by deepnvme.offload.offload_parameters (its gradient is in memory only inside its unit's "
            "backward); register_hook (called with each gradient) is, and OffloadedOptimizer steps it")


class Applied(OnDrive):
    """Stands for a gradient the optimizer applied in its unit's backward (step_in_backward=True): it is
    gone, and anything that would read it (a clip by the norm of all gradients) raises saying so."""

    @classmethod
    def _explain(cls, name: str, unit: str, func: Any) -> str:
        return (f"{name} was applied by the optimizer's step in the backward of unit {unit!r} "
                f"(OffloadedOptimizer(step_in_backward=True)) and is gone ({func} was called on it): clip "
                "per parameter with register_hook, or step after the backward (step_in_backward=False)")


@dataclass(eq=False)
class Held:
    """One offloaded parameter: its stand-in, the tensor autograd uses, its places in modules and units."""

    name: str
    real: nn.Parameter
    stand: OnDrive
    places: list[tuple[nn.Module, str]]
    data: Unit
    grad_unit: Unit | None = None
    grad: str = NO_GRAD  # where its gradient is when the stand-in's .grad is its marker
    marker: OnDrive | None = None  # the stand-in's .grad while the gradient is on the drive (or zero)
    applied: OnDrive | None = None  # the stand-in's .grad once the step in the backward applied it
    loaded_grad: bool = False  # `real.grad` holds the gradient from the drive (this backward's adds to it)

    shape: torch.Size | None = None  # the parameter's (`real` has no elements between uses)
    dtype: torch.dtype = torch.float32
    window: torch.Tensor | None = None  # the memory `real` shows while in use (saved views are of it)
    idle: torch.Tensor | None = None  # what `real` is between uses: no elements, so nothing can touch memory
    # While the window shows a lease's pool memory (lend()): a storage holding the window's own mapping.
    own: torch.UntypedStorage | None = None
    home: int = 0  # the address of the window's own mapping

    def __post_init__(self) -> None:
        self.shape = self.real.shape if self.shape is None else torch.Size(self.shape)
        self.dtype = self.real.dtype
        self.idle = torch.empty(0, dtype=self.dtype, device=self.real.device)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def grad_state(self) -> str | torch.Tensor:
        """NO_GRAD, GRAD_ON_DRIVE or GRAD_ZERO; or the tensor the caller set as the stand-in's gradient."""
        g = self.stand.grad
        if g is None:
            return NO_GRAD
        if g is self.marker:
            return self.grad
        if g is self.applied:
            return GRAD_APPLIED
        return g

    def gradient(self, lease: Any) -> torch.Tensor | None:
        """The gradient accumulated so far as a tensor of its own: the caller's, read from `lease` (which
        holds the gradient's unit when it is on the drive), zeros, or None."""
        state = self.grad_state()
        if isinstance(state, torch.Tensor):
            return state
        if state == GRAD_ZERO:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.real.device)
        if state == GRAD_ON_DRIVE:
            g = torch.empty(self.shape, dtype=self.dtype, device=self.real.device)
            g.view(-1).view(torch.uint8).copy_(lease.view(self.grad_unit))
            return g
        return None

    def park_grad(self) -> None:
        """Between uses `real.grad` is the marker when the gradient is on the drive (an optimizer holding
        `real` raises naming it, rather than seeing no gradient and silently skipping it), else None."""
        if self.real.shape != self.shape:  # not filled (an error before it was): it keeps what it has
            return
        self.real.grad = self.marker if self.grad_state() in (GRAD_ON_DRIVE, GRAD_ZERO) else None

    def _make_window(self) -> torch.Tensor:
        if self.window is None:
            # Private: MADV_DONTNEED frees private pages; shared anonymous ones would stay as shmem.
            size = round_up(max(self.nbytes, 1))
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with torch.inference_mode(False):  # made in an inference-mode forward, it could never train
                self.window = torch.frombuffer(buf, dtype=torch.uint8)[:self.nbytes].view(self.dtype).view(
                    self.shape)
            self.home = self.window.untyped_storage().data_ptr()  # its own mapping's address
            if size >= HUGE_PAGE:  # each use faults its pages in again: 2 MiB at a time is 2-3x as fast
                madvise(self.window.data_ptr(), size, mmap.MADV_HUGEPAGE)
        return self.window

    def fill(self, source: torch.Tensor) -> None:
        """Give `real` its values (`source`: the unit's bytes) in its window: memory mapped for it alone, so
        that freeing it gives the pages back to the system at once (a heap would keep them), and the views
        of it autograd saved in a forward see the values again when the unit is read for its backward."""
        self.take_back()
        self._make_window().view(-1).view(torch.uint8).copy_(source)
        self.real.data = self.window

    def can_lend(self, io_view: torch.Tensor, head: int) -> bool:
        """Whether lend() can show `io_view` (a unit's page range in the pool) as the window."""
        return (LENDING and head == 0 and self.nbytes > 0 and self.own is None
                and io_view.data_ptr() % PAGE == 0 and io_view.numel() >= round_up(self.nbytes))

    def lend(self, io_view: torch.Tensor) -> None:
        """Give `real` its values by showing the pool memory they were read into (`io_view`, checked by
        can_lend) as the window, with no copy: the window's storage is pointed at it, so the views of the
        window autograd saved see it too. The pool memory must stay the unit's until take_back()."""
        storage = self._make_window().untyped_storage()
        # `own` is set before the swap: take_back() swaps only while the window shows other memory than its
        # mapping, so a Ctrl-C landing between the two leaves nothing pointing the wrong way.
        self.own = torch._C._construct_storage_from_data_pointer(io_view.data_ptr(), io_view.device,
                                                                  storage.nbytes())
        storage._swap_data_ptr_(self.own)  # the window's storage now shows the pool; `own`, the mapping
        self.real.data = self.window

    def take_back(self) -> None:
        """Point the window's storage at its own mapping again (after lend(); else nothing): from now on
        nothing reads or writes the pool memory it showed. The mapping holds what it held before the lend
        (nothing: emptied), so a copy of the values must follow if they are still wanted."""
        if self.own is not None:
            storage = self.window.untyped_storage()  # type: ignore[union-attr]
            if storage.data_ptr() != self.home:
                storage._swap_data_ptr_(self.own)
            self.own = None

    def keep(self, io_view: torch.Tensor) -> None:
        """After lend(): copy the values from the pool memory shown (`io_view`) into the window's own
        mapping and show that, so that the pool memory can go (the values, the views, the same)."""
        if self.own is not None:
            self.fill(io_view[:self.nbytes])

    def empty(self) -> None:
        """Free the values: the window's pages go back to the system (saved views of it stay valid
        addresses, read as zeros if anything touched them) and `real` shows a tensor with no elements (code
        holding it from before the offload computes nothing out of bounds: a shape error at worst)."""
        if self.own is not None:
            self.take_back()  # its own mapping was emptied before the lend
        elif self.window is not None and self.nbytes:
            w = self.window
            madvise(w.data_ptr() // PAGE * PAGE, round_up(self.nbytes), mmap.MADV_DONTNEED)
        self.real.data = self.idle

    def show(self, real: bool) -> None:
        """Put `real` (for a use) or the stand-in (between uses) in each of its modules, where the other is:
        a tensor put there by the caller (torch.func.functional_call, a new Parameter) is left to be used."""
        want, other = (self.real, self.stand) if real else (self.stand, self.real)
        for mod, attr in self.places:
            if mod._parameters.get(attr) is other:
                mod._parameters[attr] = want


@dataclass(eq=False)
class HeldUnit:
    """One unit: its module, its offloaded parameters, and where it is in a pass."""

    index: int
    name: str
    module: nn.Module
    params: list[Held]
    present: bool = False  # the parameters' storages are filled
    depth: int = 0  # forwards (or recomputes) of it in progress
    held: bool = False  # read for its backward and not finished yet
    graphs: int = 0  # forwards outside a backward since the last step whose backward has not finished it
    orig_forward: Any = None
    had_forward: bool = False
    lease: Any = None  # the pool memory its parameters show while present (Held.lend), or None

    def lend(self, lease: Any) -> bool:
        """Show the parameters in `lease`'s pool memory with no copy (Held.lend) where every one can; the
        lease is then the unit's (`self.lease`), else nothing changed."""
        views = [(h, lease.io_view(h.data)) for h in self.params]
        if not all(h.can_lend(v, h.data.head) for h, v in views):
            return False
        try:
            for h, v in views:
                h.lend(v)
        except BaseException:
            for h in self.params:  # none may show the lease once it goes back to the pool
                h.take_back()
            raise
        self.lease = lease
        return True

    def keep_lent(self) -> None:
        """Copy lent parameters into their own windows and give the pool memory back (Held.keep). Ended by
        an error part-way, the unit is freed instead (read again on its next use), never left showing
        memory the pool has taken back or values partly copied."""
        if self.lease is None:
            return
        lease, self.lease = self.lease, None
        done = False
        try:
            for h in self.params:
                h.keep(lease.io_view(h.data))
            done = True
        finally:
            if not done:
                self.empty()
            lease.release()

    def empty(self) -> None:
        """Free the parameters' values (Held.empty) and the pool memory lent to them."""
        for h in self.params:
            h.empty()
        self.present = False
        if self.lease is not None:
            lease, self.lease = self.lease, None
            lease.release()

    def give_lent(self, stepped: list[Held]) -> Any:
        """The lease the parameters are shown in, taken back from them (Held.take_back), when it holds
        exactly `stepped`, all of them (to be written from); else None and nothing changes."""
        lease = self.lease
        if lease is None or lease.units != self.data_units() or len(stepped) != len(self.params):
            return None
        self.lease = None
        for h in self.params:
            h.take_back()
        return lease

    def data_units(self) -> list[Unit]:
        return [h.data for h in self.params]


@dataclass
class OneLender:
    """Which thread lends (HeldUnit.lend): the first to use the model, and only until another does. So the
    pool memory of a unit in use is taken back (copied out) only by the thread using it, never from under
    another thread's computation, and a thread needing room never waits under the lock for memory only
    another thread can give back. A second thread (an evaluation beside training) turns lending off and
    waits for the units lent to be freed before it uses the model."""

    on: bool = True
    thread: int | None = None

    def mine(self) -> bool:
        """Whether this thread lends."""
        return self.on and self.thread == threading.get_ident()

    def check(self, units: list[HeldUnit], idle: threading.Condition) -> None:
        """A thread begins a use of the model (`idle`'s lock held; units freed notify it)."""
        me = threading.get_ident()
        if self.on and self.thread is None:
            self.thread = me
        elif me != self.thread:
            self.on, self.thread = False, None
            if not idle.wait_for(lambda: all(u.lease is None for u in units), BUSY_WAIT_S):
                raise RuntimeError("a unit of the offloaded model stayed in use by another thread for "
                                   f"{BUSY_WAIT_S:g} s; use the model from one thread at a time")
