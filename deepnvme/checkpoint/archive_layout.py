"""One tensor's torch.save archive, laid out without its payload (torch.serialization.skip_data): the bytes
before the payload's hole and after it, which the DCP writer places around the payload it writes from the
tensor's own memory. Tensors of one layout share one laid-out archive."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch


class _ArchiveSink(io.RawIOBase):
    """Where torch.save writes one tensor's archive under skip_data: records kept, the payload left a hole."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[bytes] = []
        self.pos = 0
        self.hole: tuple[int, int] | None = None  # (offset in the archive, length) of the payload

    def writable(self) -> bool:
        """torch's zip writer writes."""
        return True

    def seekable(self) -> bool:
        """skip_data steps over the payload with a relative seek."""
        return True

    def tell(self) -> int:
        """Bytes of archive so far, the hole included."""
        return self.pos

    def write(self, data: Any) -> int:
        """Keep a record's bytes."""
        piece = bytes(memoryview(data).cast("B"))
        self.pieces.append(piece)
        self.pos += len(piece)
        return len(piece)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """The payload's hole: torch skips forward over it, once, from the current position."""
        if whence != io.SEEK_CUR or offset < 0 or self.hole is not None:
            raise io.UnsupportedOperation("only one forward skip over the payload is expected")
        head = b"".join(self.pieces)
        self.pieces = [head]
        self.hole = (self.pos, offset)
        self.pos += offset
        return self.pos


@dataclasses.dataclass
class Archive:
    """One tensor's torch.save archive: bytes before the payload, the payload's length, bytes after it."""

    head: bytes
    payload: int
    tail: bytes

    @property
    def length(self) -> int:
        """The whole archive's size in bytes."""
        return len(self.head) + self.payload + len(self.tail)


def _layout_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What torch.save(t)'s archive (payload aside) depends on, for a plain dense tensor; None for anything
    else (subclasses, tensors with Python attributes or hooks, quantized or sparse ones), which is laid out
    on its own. Tensors of one model repeat a few shapes, so their archives are laid out once per shape."""
    if (type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized or t.__dict__
            or t._backward_hooks):
        return None
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(),
            t.requires_grad, t.is_conj(), t.is_neg())


def archive_of(t: torch.Tensor, laid_out: dict[tuple[Any, ...], Archive] | None = None) -> Archive:
    """Lay out torch.save(t) without its payload (skip_data): the payload goes to disk from `t` itself.

    `laid_out` keeps the archives made so far by _layout_key: a tensor with the key of one of them gets
    the same bytes without pickling again."""
    if laid_out is None or (key := _layout_key(t)) is None:
        return lay_out(t)
    arc = laid_out.get(key)
    if arc is None:
        arc = laid_out[key] = lay_out(t)
    return arc


def lay_out(t: torch.Tensor) -> Archive:
    """torch.save(t) under skip_data, cut at the payload's hole."""
    sink = _ArchiveSink()
    with torch.serialization.skip_data():
        torch.save(t, sink)
    if sink.hole is None:  # an empty storage: nothing was skipped
        return Archive(b"".join(sink.pieces), 0, b"")
    start, length = sink.hole
    head = sink.pieces[0]
    tail = b"".join(sink.pieces[1:])
    if len(head) != start or length != t.untyped_storage().nbytes():
        raise RuntimeError("torch.save laid out an unexpected archive under skip_data")
    return Archive(head, length, tail)
