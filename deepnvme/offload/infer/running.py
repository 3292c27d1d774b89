"""One streamed model while it runs: `Streamer` reads each unit's bytes (on demand, or from the read-ahead
over the recorded order), puts views of them in place for the unit's forward (copied to the device on a
side stream on CUDA), puts the placeholders back after, and makes a swap space of its own in a forked
child (see deepnvme.offload.infer.weights for the whole story)."""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepnvme.offload.experts import ExpertStreamer
from deepnvme.offload.model import Slot
from deepnvme.offload.stores import Blob, Store, check, tensor_in
from deepnvme.offload.swap import Lease, ReadAhead, SwapSpace, Unit

#: The attribute of a streamed model that holds its Streamer.
STREAM_ATTR = "_deepnvme_stream"
# Streamed models of this process, for the fork hook below.
_LIVE: weakref.WeakSet[Streamer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child starts with only the thread that forked: a model's lock held by another thread of
    the parent (a forward in progress there) would stay held in the child for good."""
    for st in list(_LIVE):
        st.lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class UnitRun:
    """One unit of a streamed model: its module, its tensors' slots, its blobs and swap units, and the state
    of its forward while it runs (the lease, the views put in place, the device copy, the nesting depth)."""

    name: str
    module: nn.Module
    slots: list[Slot]
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


class Streamer:
    """The state of one streamed model (kept on it as STREAM_ATTR): its store, swap space, units, the read
    order once recorded and the read-ahead over it, the counts stats() gives."""

    def __init__(self, store: Store, owns_store: bool, space: SwapSpace, units: list[UnitRun],
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
        self.rows: Any = None  # the input table's RowReads (rows.py), when it is read by rows
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
        if (self.registered is not None or any(s.device.type != "cpu" for u in self.units for s in u.slots)
                or (self.rows is not None and self.rows.device.type != "cpu")):
            raise RuntimeError(f"this streamed model was on a device in process {self.pid}, before fork(): "
                               "CUDA cannot be used in a forked child; start it with the 'spawn' method")
        for u in self.units:  # a forward the parent's threads had in progress does not go on here
            if u.depth:
                self.restore(u)
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
            self.restore(u)
            if lease is not None:
                lease.release()
            u.depth -= 1
            raise

    def restore(self, u: UnitRun) -> None:
        for s in u.slots:
            s.put(s.placeholder)

    def leave(self, i: int) -> None:
        u = self.units[i]
        u.depth -= 1
        if u.depth > 0:
            return
        self.restore(u)
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
        if self.rows is not None:
            self.rows.close()
        if self.registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = 0
        self.space.close()
        if self.owns_store:
            self.store.close()


def streamer_of(model: nn.Module) -> Streamer:
    """The Streamer of a streamed `model`; ValueError when it is not streamed."""
    s = getattr(model, STREAM_ATTR, None) if isinstance(model, nn.Module) else None
    if s is None:
        raise ValueError("this model is not streamed (deepnvme.offload.stream_weights was not called on it)")
    return s


__all__ = ["STREAM_ATTR", "Streamer", "UnitRun", "streamer_of"]
