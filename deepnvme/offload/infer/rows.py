"""The input embedding table of a streamed model read by rows: each lookup reads only the rows its token ids
name, so the table (gigabytes at 128 K rows and more) neither stays in memory nor is read whole per token.

Why a path of its own and not a unit: a unit is read whole before it runs, which for the input table is
every row to look up a few; the output head does need every row (each logit is one), so it stays a unit
(or resident). A lookup's output is the rows themselves, so reading only them gives the lookup's exact
bits.

Checked bytes: when streaming starts, the table is read once, in chunks through one reused buffer (page
cache dropped behind it), its blob's CRC-32 checked where the store keeps one, and a CRC-32 of every row
kept (4 bytes a row). Each lookup's rows are checked against those: a file changed underneath since is a
StoreError naming it, the tensor and the row, never a wrong embedding.

Who: a plain `nn.Embedding` (not a subclass: its forward may do more than look up) without `max_norm`
(which rewrites the table during the lookup), whose weight no other module holds (a tied head keeps the
table as it was: resident, or a unit beside the head).
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from deepnvme.offload._doors import crc32
from deepnvme.offload.model import Placeholder, Resident, row_readable
from deepnvme.offload.stores import Store, StoreError, crc_error

#: in auto mode, tables at least this large are read by rows (below it the saving is less than a pool page
#: run's slack, and a lookup of a resident table costs nothing)
ROWS_FROM = 1 << 20
_CHUNK = 4 << 20


def row_table(model: nn.Module, residents: list[Resident], embeddings: bool | None) -> Resident | None:
    """The resident to read by rows: the model's input embedding table when it qualifies (module
    docstring) and `embeddings` is True, or None (auto) and the table holds at least ROWS_FROM bytes."""
    if embeddings is False:
        return None
    get = getattr(model, "get_input_embeddings", None)
    mod = get() if callable(get) else None
    if not row_readable(model, mod):
        return None
    for r in residents:
        if r.places == [(mod, "weight", True)] and r.tensor.dim() == 2:
            if embeddings or r.info.nbytes >= ROWS_FROM:
                return r
    return None


class RowReads:
    """One embedding table read by rows (see the module docstring): prepared (checked once, row CRCs
    kept), installed on its module (a placeholder weight and a forward that reads the rows), restored."""

    def __init__(self, store: Store, resident: Resident, name: str) -> None:
        self.store, self.info, self.name = store, resident.info, name
        self.module: nn.Embedding = resident.places[0][0]  # type: ignore[assignment]
        self.requires_grad = bool(resident.tensor.requires_grad)
        t = resident.tensor
        self.dtype, self.device = t.dtype, torch.device("cpu") if t.is_meta else t.device
        self.rows, self.width = self.info.shape
        self.row_bytes = self.info.nbytes // max(self.rows, 1)
        self.crcs = np.zeros(self.rows, dtype=np.uint32)
        self.counts = {"row_lookups": 0, "rows_read": 0, "row_bytes_read": 0}
        self.fd = -1
        self.had_forward = False
        self.orig_forward: Any = None
        self.orig_apply: Any = None

    # ------------------------------------------------------------------------------------------ reads
    def _pread(self, offset: int, buf: np.ndarray) -> None:
        """Fill `buf` from `offset`: a short read goes on where it stopped (one read returns at most about
        2 GiB); end of file before the end is a StoreError, an OSError names the file."""
        view, done = memoryview(buf).cast("B"), 0
        while done < len(view):
            try:
                got = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise OSError(exc.errno, f"reading rows of tensor {self.info.name!r}: {exc.strerror}",
                              self.info.path) from None
            if got == 0:
                raise StoreError(f"{self.info.path}: {done} of {len(view)} bytes at offset {offset} for "
                                 f"tensor {self.info.name!r} (the file was truncated underneath)")
            done += got

    def prepare(self) -> None:
        """Open the file, read the table's blob once: its CRC-32 checked where the store keeps one, each
        row's kept."""
        try:
            self.fd = os.open(self.info.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open the store file holding {self.info.name!r}: "
                          f"{exc.strerror}", self.info.path) from None
        blob = next(b for b in self.store.blobs([self.info.name]))
        buf = np.empty(min(_CHUNK, max(blob.nbytes, 1)) // max(self.row_bytes, 1) * self.row_bytes
                       or self.row_bytes, dtype=np.uint8)
        crc, at, end = 0, blob.offset, blob.offset + blob.nbytes
        first = self.info.offset
        while at < end:
            # chunks start at the table's first byte, so a chunk of the table holds whole rows
            n = min(buf.nbytes, end - at, first - at if at < first else buf.nbytes)
            part = buf[:n]
            self._pread(at, part)
            crc = crc32(part, crc)
            lo, hi = max(at, first), min(at + n, first + self.info.nbytes)
            if lo < hi:
                rows = part[lo - at:hi - at].reshape(-1, self.row_bytes)
                r0 = (lo - first) // self.row_bytes
                for i in range(rows.shape[0]):
                    self.crcs[r0 + i] = crc32(rows[i])
            os.posix_fadvise(self.fd, at, n, os.POSIX_FADV_DONTNEED)
            at += n
        if blob.crc is not None and crc != blob.crc:
            raise crc_error(blob)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (any shape) as `F.embedding(ids, table)` gives them."""
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{self.name}: token ids must be a tensor, got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise RuntimeError(f"{self.name}: token ids must be int64 or int32, got {ids.dtype}")
        flat = ids.reshape(-1).to("cpu", torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            raise IndexError(f"{self.name}: token id out of range [0, {self.rows}): got "
                             f"{int(flat.min())}..{int(flat.max())}")
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        data = np.empty((uniq.numel(), self.row_bytes), dtype=np.uint8)
        ids_np = uniq.numpy()
        start = 0
        while start < len(ids_np):  # runs of consecutive ids: one read each, its page cache dropped after
            stop = start + 1
            while stop < len(ids_np) and ids_np[stop] == ids_np[stop - 1] + 1:
                stop += 1
            at = self.info.offset + int(ids_np[start]) * self.row_bytes
            self._pread(at, data[start:stop].reshape(-1))
            os.posix_fadvise(self.fd, at, (stop - start) * self.row_bytes, os.POSIX_FADV_DONTNEED)
            start = stop
        for i, row in enumerate(ids_np):
            if crc32(data[i]) != int(self.crcs[row]):
                raise StoreError(f"{self.info.path}: row {int(row)} of tensor {self.info.name!r} differs "
                                 "from what was read when streaming started (the file changed underneath)")
        self.counts["row_lookups"] += 1
        self.counts["rows_read"] += len(ids_np)
        self.counts["row_bytes_read"] += data.size
        table = torch.from_numpy(data).view(self.info.dtype).view(-1, self.width)
        table = table.to(self.device, self.dtype)
        return table[inverse.to(self.device)].view(*ids.shape, self.width)

    # ------------------------------------------------------------------------------------------ install
    def install(self, streamer: Any) -> None:
        """The placeholder in place of the weight; the module's forward reads the rows (under the
        `streamer`'s lock, after its `adopt()`, as every forward of the streamed model; the lock is looked
        up at each call: a forked child has a new one)."""
        mod = self.module
        mod._parameters["weight"] = Placeholder(f"{self.name}.weight", f"{self.name} (read by rows)",
                                                self.info.shape, self.dtype, self.device)
        self.had_forward = "forward" in mod.__dict__
        self.orig_forward = mod.forward

        def forward(input: torch.Tensor) -> torch.Tensor:
            with streamer.lock:
                streamer.adopt()
                return self.lookup(input)

        mod.forward = forward
        self.orig_apply = mod.__dict__.get("_apply")

        def _apply(fn: Any, recurse: bool = True) -> nn.Module:
            with streamer.lock:
                probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
                self.dtype, self.device = probe.dtype, probe.device
                mod._parameters["weight"] = Placeholder(f"{self.name}.weight", f"{self.name} (read by rows)",
                                                        self.info.shape, self.dtype, self.device)
            return mod

        mod._apply = _apply  # type: ignore[method-assign]

    def restore(self, table: torch.Tensor) -> None:
        """`table` (the whole weight, read back) in place of the placeholder; the module's own methods."""
        mod = self.module
        value = table.to(self.device, self.dtype)
        mod._parameters["weight"] = nn.Parameter(value, requires_grad=self.requires_grad)
        for attr, had, orig in (("forward", self.had_forward, self.orig_forward),
                                ("_apply", self.orig_apply is not None, self.orig_apply)):
            if had:
                setattr(mod, attr, orig)
            else:
                mod.__dict__.pop(attr, None)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError as exc:  # pragma: no cover - a descriptor of ours closed elsewhere
                if exc.errno != errno.EBADF:
                    raise
            self.fd = -1


__all__ = ["ROWS_FROM", "RowReads", "row_table"]
