"""stream_weights: run a model whose weights stay on the drive, each unit (a transformer block) read in
just before its forward and given back right after, through a budget of locked memory.

How: the tensors of each unit module are replaced by placeholders (tensors without storage that raise a
clear error when computed with); the unit's `forward` is wrapped so that its tensors are views of pool
memory while it runs and placeholders again after, whatever way it ends (an exception, Ctrl-C). Tensors
outside units (embeddings, head, final norm) are read from the store once into tensors of their own, so
a model built on the meta device runs from the store alone. The first forward of the whole model records
the order in which units run (a unit called on its own is not recorded); from then on a cyclic ReadAhead
keeps reads of the next units (wrapping into the next forward) in flight as far as the budget allows, so
the drive reads while the CPU or GPU computes. A unit run out of the recorded order (an interrupted
forward, a caller running one block) restarts the read ahead from it: never wrong, only slower.

On CUDA (the model moved with `.to("cuda")`, before or after streaming), each unit's bytes are copied
from the locked pool to the device on a side stream; the compute stream waits on that copy only.

Decisions: threads running one streamed model are serialized (a lock held for each forward of the
model: the pool and the read order are the model's, not the thread's); a backward through streamed
weights raises (the views are marked modified when their memory goes back to the pool, so autograd
refuses instead of reading reused memory): streaming is for inference. Tensors whose dtype differs from
the store's (`model.half()` after streaming, a bf16 checkpoint for an fp32 model) are converted after each
read, within a kind only: a store tensor of another kind (integer, floating, bool, complex) than the
model's tensor is refused when streaming starts (store.check_kind).

fork(): the parent goes on as before. A forked child (os.fork, multiprocessing's "fork" start method) that
runs or unstreams the model makes its own swap space on its first forward (another `budget_bytes` of
locked memory, in the child) and reads from there, with the read order already recorded; the inherited
space, whose I/O threads stayed in the parent, is left alone. A model with streamed experts, or on CUDA,
raises RuntimeError in the child instead. Forking from inside a forward is not supported.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepnvme.offload import preflight
from deepnvme.offload.bulk import read_into
from deepnvme.offload.expert_stream import ExpertStreamer, split_budget
from deepnvme.offload.model_map import _tensor_slots, _unit_modules, find_tensor
from deepnvme.offload.placeholder import Placeholder
from deepnvme.offload.store import (
    Blob,
    Store,
    StoreError,
    TensorInfo,
    check,
    check_kind,
    lease_bytes,
    tensor_in,
)
from deepnvme.offload.stores import open_store
from deepnvme.offload.swap import Lease, ReadAhead, SwapSpace, Unit

_ATTR = "_deepnvme_stream"
# Streamed models of this process, for the fork hook below.
_LIVE: weakref.WeakSet[_Streamer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child starts with only the thread that forked: a model's lock held by another thread of
    the parent (a forward in progress there) would stay held in the child for good."""
    for st in list(_LIVE):
        st.lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class _Slot:
    """One tensor of a unit: where it sits in the model and in the store."""

    module: nn.Module
    attr: str
    param: bool
    requires_grad: bool
    info: TensorInfo
    dtype: torch.dtype
    device: torch.device
    placeholder: Placeholder | None = None

    def put(self, t: Any) -> None:
        (self.module._parameters if self.param else self.module._buffers)[self.attr] = t


@dataclass
class _Unit:
    name: str
    module: nn.Module
    slots: list[_Slot]
    blobs: list[Blob]
    units: list[Unit] = field(default_factory=list)
    lease: Lease | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    copied: Any = None  # the CUDA event of the copy to the device
    depth: int = 0
    position: int | None = None  # its position in the read-ahead while it runs (None: read on demand)
    orig_forward: Any = None
    had_forward: bool = False
    orig_apply: Any = None


class _Streamer:
    """The state of one streamed model (kept on it as `_deepnvme_stream`)."""

    def __init__(self, store: Store, owns_store: bool, space: SwapSpace, units: list[_Unit],
                 prefetch: bool, resident_bytes: int) -> None:
        self.store, self.owns_store, self.space, self.units = store, owns_store, space, units
        self.prefetch = prefetch
        self.lock = threading.RLock()
        self.recording: list[int] = []
        self.order: list[int] | None = None
        self.reader: ReadAhead | None = None
        self.pos = 0
        self.copy_streams: dict[torch.device, Any] = {}
        self.registered: int | None = None  # the pool's address once registered with CUDA (0: refused)
        self.counts = {"forwards": 0, "unit_reads": 0, "bytes_read": 0, "hits": 0, "stalls": 0,
                       "cache_hits": 0, "wait_s": 0.0, "resyncs": 0, "resident_bytes": resident_bytes}
        self.recycled: set[int] = set()  # positions whose lease is a recycled one (no read)
        self.root_forward: Any = None
        self.root_had_forward = False
        self.root_depth = 0  # forwards of the whole model in progress (the order is recorded only there)
        self.experts: ExpertStreamer | None = None
        self._blob_of = {x.name: b for u in units for b, x in zip(u.blobs, u.units) if b.crc is not None}
        self.check = self._check_crcs if self._blob_of else None
        self.pid = os.getpid()  # the process whose swap space this is (adopt())
        _LIVE.add(self)

    def adopt(self) -> None:
        """In a process forked from the one that streamed the model (called first thing, under the lock):
        the inherited swap space's I/O threads stayed in the parent, so the child makes a space of its own
        (same budget, same units; the read order recorded is kept) and leaves the inherited one, and the
        state of any forward the parent had in progress, untouched. Models with streamed experts and models
        on CUDA (which cannot be used in a forked child at all) raise RuntimeError instead."""
        if self.pid == os.getpid():
            return
        if self.experts is not None:
            raise RuntimeError(f"this model's experts were streamed by process {self.pid}, before fork(): "
                               "a model with streamed experts runs only there; call stream_weights in this "
                               "process (or start it with the 'spawn' method)")
        if self.registered is not None or any(s.device.type != "cpu" for u in self.units for s in u.slots):
            raise RuntimeError(f"this streamed model was on a device in process {self.pid}, before fork(): "
                               "CUDA cannot be used in a forked child; start it with the 'spawn' method")
        for u in self.units:  # a forward the parent's threads had in progress does not go on here
            if u.depth:
                self._restore(u)
            u.depth, u.lease, u.views, u.copied, u.position = 0, None, [], None, None
        space = SwapSpace(None, self.space.pool.capacity)
        try:
            for u in self.units:
                u.units = [space.add_external(x.name, x.path, x.offset, x.nbytes) for x in u.units]
        except BaseException:
            space.close()
            raise
        self.space.close()  # in the child: only marked closed (SwapSpace.close)
        self.space, self.pid, self.root_depth, self.pos = space, os.getpid(), 0, 0
        self.recycled.clear()
        self.reader = None  # the inherited one's reads were never to finish here: left, not waited for
        if self.order is not None:
            groups = [self.units[i].units for i in self.order]
            self.reader = ReadAhead(space, groups, ahead=self.prefetch, cyclic=True, check=self.check)

    def _check_crcs(self, lease: Lease) -> None:
        """The store's CRC-32s of a unit's blobs, checked on the swap space's check thread as the reads
        finish (SwapSpace.read), beside the next reads."""
        for x in lease.units:
            b = self._blob_of.get(x.name)
            if b is not None:
                check(b, lease.view(x))

    # ------------------------------------------------------------------------------------------ reads
    def _lease(self, i: int) -> Lease | None:
        """The lease of unit i, read (or taken from what was read ahead) and waited for."""
        u = self.units[i]
        t0 = time.perf_counter()
        if self.reader is None or i not in self.order:  # type: ignore[operator]
            if self.reader is None and self.root_depth:  # a block called on its own is no model order
                self.recording.append(i)
            lease = self.space.read(u.units, demand=True, check=self.check) if u.units else None
            hit = False
            try:
                if lease is not None:
                    lease.wait()
            except BaseException:
                lease.release()  # type: ignore[union-attr]
                raise
        else:
            order, n = self.order, len(self.order)  # type: ignore[arg-type]
            if order[self.pos % n] != i:
                k = next(k for k in range(n) if order[(self.pos + k) % n] == i)
                self.reader.restart(self.pos + k)
                self.recycled.clear()
                self.pos += k
                self.counts["resyncs"] += 1
            hit = self.reader.ready(self.pos)
            cached = self.pos in self.recycled
            self.recycled.discard(self.pos)
            try:
                lease = self.reader.take(self.pos)
            except BaseException:
                self.reader.restart(self.pos)
                self.recycled.clear()
                raise
            u.position = self.pos
            self.pos += 1
            if cached:
                self.counts["cache_hits"] += 1
                return lease
        self.counts["wait_s"] += time.perf_counter() - t0
        if u.units:
            self.counts["unit_reads"] += 1
            self.counts["bytes_read"] += sum(x.io_nbytes for x in u.units)
            self.counts["hits" if hit else "stalls"] += 1
        return lease

    def _copy_stream(self, device: torch.device) -> Any:
        """The side stream copies to `device` run on; the pool is registered with CUDA on first use, so
        that copies from it are DMA transfers that overlap compute (it is locked, but CUDA must know)."""
        if self.registered is None:
            memory = self.space.pool.memory
            try:
                rc = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 0)
                self.registered = memory.data_ptr() if int(rc) == 0 else 0
            except (RuntimeError, AttributeError, TypeError):
                self.registered = 0  # copies still work, staged by CUDA through its own pinned buffer
        if device not in self.copy_streams:
            self.copy_streams[device] = torch.cuda.Stream(device)
        return self.copy_streams[device]

    # ------------------------------------------------------------------------------------------ units
    def enter(self, i: int) -> None:
        u = self.units[i]
        u.depth += 1
        if u.depth > 1:  # the unit calls itself (shared block): its tensors are in place already
            return
        try:
            lease = self._lease(i)
        except BaseException:
            u.depth -= 1
            raise
        try:
            views = {}
            for b, x in zip(u.blobs, u.units):
                data = lease.view(x)  # type: ignore[union-attr]
                for info in b.tensors:
                    views[info.name] = tensor_in(b, info, data)
            cuda = [s.device for s in u.slots if s.device.type == "cuda"]
            stream = self._copy_stream(cuda[0]) if cuda else None
            out = []
            for s in u.slots:
                v = views[s.info.name]
                if s.device.type == "cuda":
                    with torch.cuda.stream(stream):  # allocated and filled on the copy stream
                        v = v.to(s.device, non_blocking=True)
                        if v.dtype != s.dtype:
                            v = v.to(s.dtype)
                elif v.dtype != s.dtype or v.device != s.device:
                    v = v.to(s.device, s.dtype)
                out.append(v)
            if stream is not None:
                u.copied = stream.record_event()
                current = torch.cuda.current_stream(cuda[0])
                current.wait_event(u.copied)
                for v in out:
                    if v.is_cuda:
                        v.record_stream(current)
            for s, v in zip(u.slots, out):
                s.put(v)
            u.views, u.lease = out, lease
        except BaseException:
            self._restore(u)
            if lease is not None:
                lease.release()
            u.depth -= 1
            raise

    def _restore(self, u: _Unit) -> None:
        for s in u.slots:
            s.put(s.placeholder)

    def leave(self, i: int) -> None:
        u = self.units[i]
        u.depth -= 1
        if u.depth > 0:
            return
        self._restore(u)
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            # Autograd may have saved these views; their memory is about to be reused: a backward through
            # them then raises ("modified by an inplace operation") instead of reading other weights.
            for v in u.views:
                if not v.is_inference():
                    torch.autograd.graph.increment_version(v)
        u.views = []
        lease, u.lease = u.lease, None
        if u.copied is not None:
            u.copied.synchronize()  # the locked buffer goes back to the pool once the device has it
            u.copied = None
        position, u.position = u.position, None
        if self.reader is not None and position is not None and self.reader.recycle(position, lease):
            self.recycled.add(position + len(self.order))  # type: ignore[arg-type]
        elif lease is not None:
            lease.release()
        if self.reader is not None:
            self.reader.pump()

    def end_forward(self, ok: bool) -> None:
        """After a forward of the whole model: the first complete one fixes the read order."""
        self.counts["forwards"] += 1
        if self.reader is None:
            if ok and self.recording:
                self.order = list(self.recording)
                groups = [self.units[i].units for i in self.order]
                self.reader = ReadAhead(self.space, groups, ahead=self.prefetch, cyclic=True,
                                        check=self.check)
                self.pos = 0
                self.reader.pump()
            self.recording = []

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.experts is not None:
            self.experts.close()
        if self.registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = 0
        self.space.close()
        if self.owns_store:
            self.store.close()


# ---------------------------------------------------------------------------------------------- helpers
# ---------------------------------------------------------------------------------------------- the API
def stream_weights(model: nn.Module, store: Store | str | os.PathLike, budget_bytes: int, *,
                   units: Any = None, prefetch: bool = True, expert_lookahead: int = 0) -> nn.Module:
    """Make `model` run with the weights of its units on the drive (see the module docstring).

    `store`: a Store (store.py) or the path of one (a safetensors file or checkpoint directory, sharded or
    not, or a directory written by write_store). `budget_bytes`: the locked memory units are read into; it
    must hold the largest unit, and what is left runs reads ahead. `units`: None for the model's repeated
    blocks, the name of a module whose children are the units, or a list of modules or module names.
    `prefetch=False` reads each unit only when it runs, and each expert only when routed to (by default
    the next layers' experts are read ahead when a layer's tokens are expected to use nearly all of its
    own: expert_stream.FULL_USE). `expert_lookahead`: for Mixture-of-Experts models
    whose routers are found (Hugging Face, Mixtral-style), how many layers ahead each MoE layer guesses
    the experts with their routers applied to its own input and reads them behind its own ("pre-gating";
    0, the default: experts are read only when routed to; `prefetch=False` implies 0). A guess never
    changes the output; what guesses read, used and wasted is in `stats(model)["experts"]`. Why off by
    default: a guess that is wrong costs a read, and the room it takes costs a cached expert's later
    hit; it pays where the next layer's routing is well predicted and read bandwidth is to spare
    (bench/stream_bench.py measures both). Returns `model`, changed in place.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    budget_bytes = preflight.budget_arg(budget_bytes)
    if isinstance(expert_lookahead, bool) or not isinstance(expert_lookahead, int) or expert_lookahead < 0:
        raise ValueError(f"expert_lookahead must be an int >= 0, got {expert_lookahead!r}")
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError("this model is streamed already: call deepnvme.offload.unstream(model) first")
    owns = not isinstance(store, Store)
    if owns:
        if not isinstance(store, (str, os.PathLike)):
            raise TypeError(f"store must be a Store or a path, got {type(store).__name__}")
        store = open_store(store)
    try:
        return _stream(model, store, owns, budget_bytes, units, prefetch, expert_lookahead if prefetch else 0)
    except BaseException:
        if owns:
            store.close()
        raise


def _warn_unused(store: Store, used: list[TensorInfo]) -> None:
    """Warn, naming a few, when store tensors fill nothing in the model: a checkpoint of a larger model
    (six blocks for a model of four) streams without an error, since checkpoints legitimately carry
    tensors a model ignores (a head the base model lacks, a saved attention mask). A tensor whose bytes a
    used one shares (tied weights listed under both names) is used; so is a fused expert tensor whose
    slices (named `<tensor>[<expert>]`, expert_sets.py) are."""
    tensors = store.tensors()
    names = {i.name if i.name in tensors else i.name.rsplit("[", 1)[0] for i in used}
    places = {(i.path, i.offset, i.nbytes) for i in used}
    unused = [n for n, i in tensors.items() if n not in names and (i.path, i.offset, i.nbytes) not in places]
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        warnings.warn(f"{len(unused)} tensors of the store {store.path} fill nothing in the model and are "
                      f"not read: {', '.join(repr(n) for n in unused[:5])}{more} (a store for a larger or "
                      "another model?)", UserWarning, stacklevel=4)


def _stream(model: nn.Module, store: Store, owns: bool, budget: int, units: Any, prefetch: bool,
            lookahead: int) -> nn.Module:
    from deepnvme.offload._doors import PAGE

    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # a model built with init_empty_weights has its tied parameters apart until tied
    chosen = _unit_modules(model, units)
    # Experts are units of their own (expert_stream.py).
    experts = ExpertStreamer.for_model(model, store, lookahead, read_ahead=prefetch)
    unit_of = {}  # module name prefix -> unit index
    for k, (n, _) in enumerate(chosen):
        unit_of[n] = k
    tensors = store.tensors()
    slots: dict[int, list[_Slot]] = {k: [] for k in range(len(chosen))}
    residents: list[tuple[torch.Tensor, TensorInfo, list[tuple[nn.Module, str, bool]]]] = []
    missing: list[str] = []
    for aliases in _tensor_slots(model).values():
        full = [a[0] for a in aliases]
        mod0, attr0, is_param = aliases[0][2], aliases[0][3], aliases[0][4]
        t = (mod0._parameters if is_param else mod0._buffers)[attr0]
        if experts is not None and id(t) in experts.owned:
            continue
        homes = set()
        for _, mname, *_ in aliases:
            home = next((k for p, k in unit_of.items() if mname == p or mname.startswith(p + ".")), None)
            homes.add(home)
        info = find_tensor(tensors, model, full)
        if info is None:
            if is_param or t.is_meta:
                if not is_param and attr0 in mod0._non_persistent_buffers_set:
                    raise StoreError(f"buffer {full[0]!r} is on the meta device and no checkpoint holds it "
                                     "(a non-persistent buffer): build the model with accelerate's "
                                     "init_empty_weights (buffers stay real), not torch.device('meta')")
                missing.append(full[0])
            continue  # a buffer the store does not hold stays as it is (rotary frequencies)
        if tuple(t.shape) != info.shape:
            raise StoreError(f"tensor {info.name!r} in {info.path}: shape {info.shape} in the store, "
                             f"{tuple(t.shape)} in the model (a store for another model?)")
        check_kind(info, t.dtype, full[0])
        device = torch.device("cpu") if t.is_meta else t.device
        if len(homes) == 1 and None not in homes:
            k = homes.pop()
            for _, _, mod, attr, p in aliases:
                slots[k].append(_Slot(mod, attr, p, bool(t.requires_grad), info, t.dtype, device))
        else:
            residents.append((t, info, [(a[2], a[3], a[4]) for a in aliases]))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise StoreError(f"{len(missing)} tensors of the model are not in the store {store.path}: "
                         f"{', '.join(repr(n) for n in missing[:5])}{more} (a store for another model?)")
    used = [s.info for k in slots for s in slots[k]] + [info for _, info, _ in residents]
    if experts is not None:
        used += [p.info for x in experts.experts.values() for p in x.parts]
    _warn_unused(store, used)
    plan = []
    for k, (name, mod) in enumerate(chosen):
        names = list(dict.fromkeys(s.info.name for s in slots[k]))
        blobs = store.blobs(names) if names else []
        need = lease_bytes(blobs)
        if need > budget // PAGE * PAGE:
            raise ValueError(f"unit {name!r} takes {need} bytes of locked memory, over "
                             f"budget_bytes={budget}: raise budget_bytes to at least {need} (more lets "
                             "reads run ahead)")
        plan.append(_Unit(name, mod, slots[k], blobs))
    expert_bytes = 0
    if experts is not None:
        budget, expert_bytes = split_budget(budget, [lease_bytes(u.blobs) for u in plan],
                                            experts.largest)
    space = SwapSpace(None, budget)
    try:
        dests = {}
        for t, info, _ in residents:
            device = torch.device("cpu") if t.is_meta else t.device
            dests[info.name] = torch.empty(info.shape, dtype=info.dtype, device=device)
        read_into(space, store, dests)
        resident_bytes = 0
        for t, info, aliases in residents:
            new = dests[info.name]
            if new.dtype != t.dtype:
                new = new.to(t.dtype)
            resident_bytes += new.numel() * new.element_size()
            value = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
            for mod, attr, p in aliases:
                (mod._parameters if p else mod._buffers)[attr] = value
        for u in plan:
            u.units = [space.add_external(f"{u.name}#{j}", b.path, b.offset, b.nbytes)
                       for j, b in enumerate(u.blobs)]
        streamer = _Streamer(store, owns, space, plan, prefetch, resident_bytes)
        if experts is not None:
            experts.install(space, expert_bytes)
            streamer.experts = experts
    except BaseException:
        space.close()
        raise
    for i, u in enumerate(plan):
        for s in u.slots:
            s.placeholder = Placeholder(f"{u.name}.{_rel(u, s)}", u.name, s.info.shape, s.dtype,
                                        s.device)
            s.put(s.placeholder)
        _wrap_unit(streamer, i, u)
    _wrap_root(streamer, model)
    setattr(model, _ATTR, streamer)
    return model


def _rel(u: _Unit, s: _Slot) -> str:
    for n, m in u.module.named_modules():
        if m is s.module:
            return f"{n}.{s.attr}" if n else s.attr
    return s.attr


def _wrap_unit(streamer: _Streamer, i: int, u: _Unit) -> None:
    mod = u.module
    u.had_forward = "forward" in mod.__dict__
    u.orig_forward = mod.forward

    @functools.wraps(u.orig_forward)  # the signature stays visible (generate() inspects it)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with streamer.lock:
            streamer.adopt()
            streamer.enter(i)
            try:
                return u.orig_forward(*args, **kwargs)
            finally:
                streamer.leave(i)

    mod.forward = forward
    u.orig_apply = mod.__dict__.get("_apply")

    def _apply(fn: Any, recurse: bool = True) -> nn.Module:
        with streamer.lock:
            for s in u.slots:
                probe = fn(torch.empty(0, dtype=s.dtype, device=s.device))
                s.dtype, s.device = probe.dtype, probe.device
            for s in u.slots:
                s.put(None)
            try:
                type(mod)._apply(mod, fn, recurse)
            finally:
                for s in u.slots:
                    s.placeholder = Placeholder(s.placeholder._name, u.name, s.info.shape, s.dtype, s.device)
                    s.put(s.placeholder)
        return mod

    mod._apply = _apply  # type: ignore[method-assign]


def _wrap_root(streamer: _Streamer, model: nn.Module) -> None:
    streamer.root_had_forward = "forward" in model.__dict__
    streamer.root_forward = model.forward

    @functools.wraps(streamer.root_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with streamer.lock:
            streamer.adopt()
            ok = False
            streamer.root_depth += 1
            try:
                out = streamer.root_forward(*args, **kwargs)
                ok = True
                return out
            finally:
                streamer.root_depth -= 1
                streamer.end_forward(ok)

    model.forward = forward


def _streamer(model: nn.Module) -> _Streamer:
    s = getattr(model, _ATTR, None) if isinstance(model, nn.Module) else None
    if s is None:
        raise ValueError("this model is not streamed (deepnvme.offload.stream_weights was not called on it)")
    return s


def unstream(model: nn.Module) -> nn.Module:
    """Undo stream_weights: every streamed tensor is read back into memory (on the device and in the dtype
    its placeholder had), the forwards are the model's own again, the pool and files are released."""
    st = _streamer(model)
    with st.lock:
        st.adopt()
        if st.reader is not None:
            st.reader.close()
        dests: dict[str, torch.Tensor] = {}
        for u in st.units:
            for s in u.slots:
                if s.info.name not in dests:
                    dests[s.info.name] = torch.empty(s.info.shape, dtype=s.info.dtype, device=s.device)
        read_into(st.space, st.store, dests)
        made: dict[tuple[str, torch.dtype, torch.device, bool], Any] = {}
        for u in st.units:
            for s in u.slots:
                key = (s.info.name, s.dtype, s.device, s.param)
                if key not in made:
                    t = dests[s.info.name].to(s.device, s.dtype)
                    made[key] = nn.Parameter(t, requires_grad=s.requires_grad) if s.param else t
                s.put(made[key])
            _unwrap(u.module, u.had_forward, u.orig_forward, "forward")
            _unwrap(u.module, u.orig_apply is not None, u.orig_apply, "_apply")
        _unwrap(model, st.root_had_forward, st.root_forward, "forward")
        if st.experts is not None:
            st.experts.restore()
        delattr(model, _ATTR)
        st.close()
    return model


def _unwrap(mod: nn.Module, had: bool, orig: Any, attr: str) -> None:
    if had:
        setattr(mod, attr, orig)
    else:
        mod.__dict__.pop(attr, None)


def stats(model: nn.Module) -> dict[str, Any]:
    """Statistics of a streamed model: `forwards`, `unit_reads` (units read into the pool), `bytes_read`,
    `hits` (unit reads finished before the unit ran: prefetch hits) and `stalls` (the forward waited),
    `cache_hits` (units still in the pool from the pass before: with a budget that holds every unit,
    nothing is read again), `wait_s` (seconds forwards waited for reads), `resyncs` (units run out of
    the recorded order), `resident_bytes` (tensors outside units, in memory), `streamed_bytes` (all
    units), `units`, `budget_bytes`, `pool_peak_bytes`, `order_recorded`, `prefetch`; for a model with
    experts, `experts`: the expert cache's (expert_stream.ExpertStreamer.stats)."""
    st = _streamer(model)
    with st.lock:
        out = dict(st.counts)
        out["units"] = len(st.units)
        out["streamed_bytes"] = sum(b.nbytes for u in st.units for b in u.blobs)
        out["budget_bytes"] = st.space.pool.capacity
        out["pool_peak_bytes"] = st.space.pool.peak_in_use
        out["order_recorded"] = st.order is not None
        out["prefetch"] = st.prefetch
        if st.experts is not None:
            out["experts"] = st.experts.stats()
    return out
