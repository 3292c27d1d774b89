"""torch's archive as deepnvme.save writes it: the stream torch.save writes into (payloads handed to the
handle from their own memory, records staged, CRC-32s computed beside the writes), the storages that may be
written asynchronously, and the per-thread settings that page-align the payloads."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

from deepnvme._core import zipformat
from deepnvme._core.crc import crc32
from deepnvme._core.direct import DIRECT_MIN_BYTES, AlignedWriter
from deepnvme._core.memory import address_of, byte_view, memory_of

# Page alignment of storage payloads in the archives save writes (torch's default is 64).
STORAGE_ALIGNMENT = 4096


class SaveStream:
    """The file object torch.save writes into: positions its bytes, hands payloads over with their memory.

    With `checksums`, torch computes no CRC-32 (its one-core CRC is slower than the disk) and the stream
    fills them in: each record's CRC is computed here with crc32 (zlib-ng), right after its payload was
    queued to the handle, so it overlaps that payload's own write; the CRC goes into the record's data
    descriptor (which torch's zip writer puts right after the data) and into the central directory
    (held back until torch has written all of it).
    """

    def __init__(self, writer: AlignedWriter, storages: dict[tuple[int, int], Any],
                 checksums: bool = False, payloads: Any = None) -> None:
        self._writer = writer
        self._storages = storages
        self._payloads = payloads
        self._zip = zipformat.CrcFollower() if checksums else None
        self.pos = 0
        # The first error a write raised (OSError EMFILE from the handle, KeyboardInterrupt...). torch's zip
        # writer finishes the archive even after one, and the write that follows fails on torch's own check
        # ("unexpected pos"): that RuntimeError would hide this. save() raises this instead, and every write
        # after it is dropped (the temporary is discarded).
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.error is not None:
            return len(memoryview(data).cast("B"))
        try:
            return self._write(data)
        except BaseException as exc:
            self.error = exc
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        source = supplied = None
        if n >= DIRECT_MIN_BYTES or self._payloads is not None:
            storage = self._storages.get((address_of(view), n))
            if storage is not None and self._payloads is not None:
                supplied = self._payloads(storage)
            if supplied is not None and not hasattr(supplied, "numel"):
                return self._write_pieces(supplied, n)
            if supplied is not None:
                if supplied.numel() != n:
                    raise ValueError(f"payloads gave {supplied.numel()} bytes for a storage of {n}")
                source, view = supplied, memory_of(supplied)
            elif storage is not None and n >= DIRECT_MIN_BYTES:
                source = byte_view(storage)
        if self._zip is None:
            self._writer.put(view, self.pos, source)
        else:
            for piece, at, piece_source in self._zip.feed(view, self.pos, source is not None):
                self._writer.put(piece, at, source if piece_source else None)
            self._zip.settle()
        if supplied is not None:  # the caller may reuse that memory once this returns
            self._writer.wait()
        self.pos += n
        return n

    def _write_pieces(self, pieces: Any, n: int) -> int:
        """Write a storage's `n` bytes given as consecutive uint8 tensors (a payload larger than the memory
        that supplies it), each written before the next is asked for; its CRC-32 is computed as they go."""
        zip_data = self._zip is not None and self._zip.expects_data()
        if self._zip is not None and not zip_data:
            self._zip.lost("a payload in pieces came outside a member's data")
        at, crc = self.pos, 0
        for piece in pieces:
            if at - self.pos + piece.numel() > n:
                raise ValueError(f"payloads gave more than the {n} bytes of the storage")
            view = memory_of(piece)
            self._writer.put(view, at, piece)
            if zip_data:
                crc = crc32(view, crc)
            self._writer.wait()  # the caller may reuse that memory for the next piece
            at += piece.numel()
        if at - self.pos != n:
            raise ValueError(f"payloads gave {at - self.pos} bytes for a storage of {n}")
        if zip_data:
            self._zip.data_written(n, crc)  # type: ignore[union-attr]
        self.pos += n
        return n

    def close_archive(self) -> None:
        """Write what the checksum bookkeeping held back (the central directory, its CRCs filled in)."""
        if self._zip is not None:
            for piece, at, _ in self._zip.close():
                self._writer.put(piece, at)

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """torch.serialization.skip_data() seeks over payloads; the skipped bytes stay zero."""
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset}.get(whence)
        if target is None or target < self.pos:
            raise io.UnsupportedOperation("the save stream only seeks forward")
        if self._zip is not None:
            self._zip.lost("the stream seeked")
        self.pos = target
        return target

    def flush(self) -> None:
        """The bytes are already on their way; save() waits for them before the rename."""


def storages_of(obj: Any, pickle_module: Any, protocol: int) -> dict[tuple[int, int], Any]:
    """The CPU storages pickling `obj` reaches, by (address, bytes): the memory that outlives torch.save."""
    import torch

    found: dict[tuple[int, int], Any] = {}

    class _Finder(pickle_module.Pickler):  # type: ignore[name-defined, misc]
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage):
                o = o._untyped_storage  # what torch.save itself writes; .untyped() would warn
            elif not isinstance(o, torch.UntypedStorage):
                return None
            if o.device.type == "cpu" and o.nbytes() > 0:
                found[(o.data_ptr(), o.nbytes())] = o
            return 0

    _Finder(_NullSink(), protocol).dump(obj)
    return found


class _NullSink:
    """Discards what the storage finder pickles."""

    def write(self, data: Any) -> int:
        return len(data)


@contextlib.contextmanager
def page_aligned_storages(crc: bool = True) -> Iterator[bool]:
    """Page-aligned storage records, and torch's CRC-32s on or off, for the saves of this thread; yields
    whether torch takes these settings (an older torch computes its CRCs and aligns to 64 bytes).

    torch keeps these settings per thread (ContextVar-backed config), so concurrent saves and a plain
    torch.save in another thread do not see each other's choices.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: records stay 64-aligned and payloads are staged, still correct
        yield False
        return
    alignment = config.save.storage_alignment
    if alignment % STORAGE_ALIGNMENT:
        alignment = STORAGE_ALIGNMENT
    with config.patch({"save.storage_alignment": alignment, "save.compute_crc32": crc}):
        yield True
