"""stream_weights: run a model whose weights stay on the drive, each unit (a transformer block) read in
just before its forward and given back right after, through a budget of locked memory.

How: the tensors of each unit module are replaced by placeholders (tensors without storage that raise a
clear error when computed with); the unit's `forward` is wrapped so that its tensors are views of pool
memory while it runs and placeholders again after, whatever way it ends (an exception, Ctrl-C). Tensors
outside units (embeddings, head, final norm) are read from the store once into tensors of their own, so
a model built on the meta device runs from the store alone. The first forward records the order in which
units run; from then on a cyclic ReadAhead keeps reads of the next units (wrapping into the next
forward) in flight as far as the budget allows, so the drive reads while the CPU or GPU computes. A unit
run out of the recorded order (an interrupted forward, a caller running one block) restarts the read
ahead from it: never wrong, only slower.

On CUDA (the model moved with `.to("cuda")`, before or after streaming), each unit's bytes are copied
from the locked pool to the device on a side stream; the compute stream waits on that copy only.

Decisions: threads running one streamed model are serialized (a lock held for each forward of the
model: the pool and the read order are the model's, not the thread's); a backward through streamed
weights raises (the views are marked modified when their memory goes back to the pool, so autograd
refuses instead of reading reused memory): streaming is for inference. Tensors whose dtype differs from
the store's (`model.half()` after streaming) are converted after each read.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepnvme.offload.bulk import read_into
from deepnvme.offload.expert_stream import ExpertStreamer, split_budget
from deepnvme.offload.pool import round_up
from deepnvme.offload.store import Blob, Store, StoreError, TensorInfo, check, open_store, tensor_in
from deepnvme.offload.swap import Lease, ReadAhead, SwapSpace, Unit

_ATTR = "_deepnvme_stream"


class StreamedWeightError(RuntimeError):
    """A streamed tensor was used outside the forward of its unit."""


class Placeholder(torch.Tensor):
    """Stands for a streamed tensor between forwards: shape, dtype and device are the real ones (code that
    asks `model.device` or `model.dtype` works); any computation raises StreamedWeightError naming it."""

    _name: str
    _unit: str

    @staticmethod
    def __new__(cls, name: str, unit: str, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device) -> Placeholder:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        t._name, t._unit = name, unit
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Placeholder)]
        what = found[0] if found else None
        name = what._name if what is not None else "a streamed tensor"
        unit = what._unit if what is not None else "?"
        raise StreamedWeightError(
            f"{name} is streamed from the drive by deepnvme.offload.stream_weights: its values exist only "
            f"during the forward of unit {unit!r} ({func} was called outside it); run the model, or call "
            "deepnvme.offload.unstream(model) to have the weights in memory again")

    def __repr__(self, **_: Any) -> str:  # type: ignore[override]
        return (f"Placeholder({self._name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, streamed by deepnvme.offload)")


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
        self.experts: ExpertStreamer | None = None
        self._blob_of = {x.name: b for u in units for b, x in zip(u.blobs, u.units) if b.crc is not None}
        self.check = self._check_crcs if self._blob_of else None

    def _check_crcs(self, lease: Lease) -> None:
        """The store's CRC-32s of a unit's blobs, checked on the read thread as the reads finish."""
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
            if self.reader is None:
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
        if self.registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = 0
        if self.experts is not None:
            self.experts.close()
        self.space.close()
        if self.owns_store:
            self.store.close()


# ---------------------------------------------------------------------------------------------- helpers
def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of repeated blocks holding the most parameters (GPT-2's transformer.h, Llama's
    model.layers)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(c) for c in mod}) == 1:
            n = sum(p.numel() * p.element_size() for p in mod.parameters())
            if n > 0 and (best is None or n > best[0]):
                best = (n, name, mod)
    if best is None:
        raise ValueError(f"no ModuleList of repeated blocks with parameters in {type(model).__name__}: pass "
                         "units= (the name of the module list, or a list of modules or module names)")
    return best[1], best[2]


def _unit_modules(model: nn.Module, units: Any) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    if units is None:
        chosen: list[Any] = list(_blocks(model)[1])
    elif isinstance(units, str):
        try:
            container = model.get_submodule(units)
        except AttributeError:
            raise ValueError(f"units={units!r}: no such module in {type(model).__name__}") from None
        chosen = list(container.children())
        if not chosen:
            raise ValueError(f"units={units!r}: the module has no children to stream one by one")
    elif isinstance(units, (list, tuple)) and units:
        chosen = list(units)
    else:
        raise TypeError("units must be None, a module name or a non-empty list of modules or names, "
                        f"got {units!r}")
    out = []
    for c in chosen:
        if isinstance(c, str):
            try:
                c = model.get_submodule(c)
            except AttributeError:
                raise ValueError(f"units: no module named {c!r} in {type(model).__name__}") from None
        if not isinstance(c, nn.Module) or id(c) not in names:
            raise ValueError(f"units: {c!r} is not a submodule of the model")
        if c is model:
            raise ValueError("units: the model itself cannot be a unit (its blocks are)")
        out.append((names[id(c)], c))
    seen = [n for n, _ in out]
    for a in seen:
        for b in seen:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"units: {b!r} lies inside {a!r}; units must not nest")
    if len(set(seen)) != len(seen):
        raise ValueError("units: a module is named twice")
    return out


def _tensor_slots(model: nn.Module) -> dict[int, list[tuple[str, str, nn.Module, str, bool]]]:
    """Every tensor of the model by identity: its (full name, module name, module, attribute, is_param)."""
    out: dict[int, list[tuple[str, str, nn.Module, str, bool]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for is_param, tensors in ((True, mod._parameters), (False, mod._buffers)):
            for attr, t in tensors.items():
                if t is not None:
                    full = f"{mname}.{attr}" if mname else attr
                    out.setdefault(id(t), []).append((full, mname, mod, attr, is_param))
    return out


def tensor_aliases(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct tensor of the model (parameters and buffers) with all the names it has (tied weights
    have several)."""
    out = []
    for aliases in _tensor_slots(model).values():
        mod, attr, p = aliases[0][2], aliases[0][3], aliases[0][4]
        out.append(([a[0] for a in aliases], (mod._parameters if p else mod._buffers)[attr]))
    return out


def unit_names(model: nn.Module, units: Any = None) -> list[str]:
    """The qualified names of the modules stream_weights makes units of (same `units` argument)."""
    return [n for n, _ in _unit_modules(model, units)]


def _find(store_tensors: Any, model: nn.Module, names: list[str]) -> TensorInfo | None:
    from deepnvme.offload.expert_sets import checkpoint_names

    prefix = getattr(model, "base_model_prefix", "") or ""
    for n in [c for x in names for c in checkpoint_names(model, x)]:
        candidates = [n]
        if prefix:
            candidates += [n[len(prefix) + 1:]] if n.startswith(prefix + ".") else [f"{prefix}.{n}"]
        for c in candidates:
            if c in store_tensors:
                return store_tensors[c]
    return None


def _lease_bytes(blobs: list[Blob], page: int) -> int:
    return sum(round_up(round_up(b.offset + b.nbytes) - b.offset // page * page) for b in blobs)


# ---------------------------------------------------------------------------------------------- the API
def stream_weights(model: nn.Module, store: Store | str | os.PathLike, budget_bytes: int, *,
                   units: Any = None, prefetch: bool = True) -> nn.Module:
    """Make `model` run with the weights of its units on the drive (see the module docstring).

    `store`: a Store (store.py) or the path of one (a safetensors file or checkpoint directory, sharded or
    not, or a directory written by write_store). `budget_bytes`: the locked memory units are read into; it
    must hold the largest unit, and what is left runs reads ahead. `units`: None for the model's repeated
    blocks, the name of a module whose children are the units, or a list of modules or module names.
    `prefetch=False` reads each unit only when it runs. Returns `model`, changed in place.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError("this model is streamed already: call deepnvme.offload.unstream(model) first")
    owns = not isinstance(store, Store)
    if owns:
        if not isinstance(store, (str, os.PathLike)):
            raise TypeError(f"store must be a Store or a path, got {type(store).__name__}")
        store = open_store(store)
    try:
        return _stream(model, store, owns, budget_bytes, units, prefetch)
    except BaseException:
        if owns:
            store.close()
        raise


def _stream(model: nn.Module, store: Store, owns: bool, budget: int, units: Any, prefetch: bool) -> nn.Module:
    from deepnvme.offload._doors import PAGE

    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # a model built with init_empty_weights has its tied parameters apart until tied
    chosen = _unit_modules(model, units)
    experts = ExpertStreamer.for_model(model, store)  # experts are units of their own (expert_stream.py)
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
        info = _find(tensors, model, full)
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
    plan = []
    unit_budget = budget if experts is None else budget - experts.largest
    for k, (name, mod) in enumerate(chosen):
        names = list(dict.fromkeys(s.info.name for s in slots[k]))
        blobs = store.blobs(names) if names else []
        need = _lease_bytes(blobs, PAGE)
        if need > unit_budget // PAGE * PAGE:
            raise ValueError(f"unit {name!r} takes {need} bytes of locked memory, over "
                             f"budget_bytes={budget}: raise budget_bytes to at least {need} (more lets "
                             "reads run ahead)")
        plan.append(_Unit(name, mod, slots[k], blobs))
    expert_bytes = 0
    if experts is not None:
        largest = max((_lease_bytes(u.blobs, PAGE) for u in plan), default=0)
        budget, expert_bytes = split_budget(budget, largest, experts.largest)
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
            ok = False
            try:
                out = streamer.root_forward(*args, **kwargs)
                ok = True
                return out
            finally:
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
    units), `units`, `budget_bytes`, `pool_peak_bytes`, `order_recorded`, `prefetch`."""
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
