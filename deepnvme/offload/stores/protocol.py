"""The store protocol: where the bytes of a model's tensors lie on the drive, for streaming them.

Weights are streamed from a store (deepnvme.offload.infer; the MoE expert cache reads experts the same
way). A store says, for each tensor name (the model's state-dict names), where its bytes are: a
`TensorInfo` with the file, the byte offset, the length, the dtype and the shape; nothing is read when a
store is opened beyond its header or manifest, which is validated then (a tensor past the end of its
file, a length that does not match dtype and shape, an unknown dtype: a `StoreError` naming the tensor
and the file).

Readers move bytes in `Blob`s: a byte range of one file covering one or more tensors. `blobs(names)`
covers the named tensors with as few ranges as it can: deepnvme's own store (own_read.py) keeps each
unit's tensors in one aligned, contiguous blob, so a unit is one request; a safetensors checkpoint
(safetensors_read.py) gives the runs of tensors that lie back to back in a file. Blobs
carry the CRC-32 of their bytes where the store keeps one (deepnvme's store does; safetensors has none):
readers check it with `check(blob, data)`.

Implementations: `SafetensorsStore` (a Hugging Face checkpoint, one file or sharded, read in place) and
`OwnStore` (written by own_write.py, from a model by `write_store`). `open_store(path)` (kinds.py)
picks by what is at `path`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from deepnvme.offload._doors import PAGE, crc32
from deepnvme.offload.swap import round_up

# Tensors of one run may be apart by up to this many bytes and still be read in one request (the gap is
# read and ignored): one request costs more than a page of bandwidth.
MERGE_GAP = PAGE


class StoreError(ValueError):
    """A store does not hold what the model needs, or its header or manifest is wrong; names the tensor
    and the file."""


@dataclass(frozen=True)
class TensorInfo:
    """`nbytes` at `offset` of `path` hold tensor `name` (`dtype`, `shape`, C order, little-endian)."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Blob:
    """`nbytes` at `offset` of `path`: one read request; tensor t lies at t.offset - offset in it.
    `crc` is the CRC-32 of the range where the store keeps one (else None)."""

    path: str
    offset: int
    nbytes: int
    tensors: tuple[TensorInfo, ...] = field(default=())
    crc: int | None = None


@runtime_checkable
class Store(Protocol):
    """What the streaming code asks of a store (see the module docstring)."""

    path: str

    def tensors(self) -> Mapping[str, TensorInfo]:
        """Every tensor of the store, by name."""
        ...

    def blobs(self, names: Iterable[str]) -> list[Blob]:
        """Read requests covering exactly the tensors `names` (KeyError naming one that is missing)."""
        ...

    def close(self) -> None:
        """Release what the store holds open (idempotent)."""
        ...


def dtype_kind(dtype: torch.dtype) -> str:
    """"bool", "complex", "floating" or "integer": values of one kind convert meaningfully (bf16 to fp32),
    of two kinds they do not (I32 bytes read as F32 weights are garbage)."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def check_kind(info: TensorInfo, dtype: torch.dtype, model_name: str) -> None:
    """Refuse store tensor `info` for model tensor `model_name` of `dtype` when the two dtypes are of
    different kinds (conversions within a kind, such as bf16 to fp32, are done after each read)."""
    if dtype_kind(info.dtype) != dtype_kind(dtype):
        raise StoreError(f"tensor {info.name!r} in {info.path}: {info.dtype} ({dtype_kind(info.dtype)}) in "
                         f"the store, {dtype} ({dtype_kind(dtype)}) for {model_name!r} in the model: not "
                         "converted between kinds (a store for another model, or a damaged header?)")


def runs(infos: Iterable[TensorInfo], gap: int = MERGE_GAP) -> list[Blob]:
    """The tensors grouped into blobs of neighbours in a file (apart by at most `gap` bytes), by file and
    offset: the fewest requests that read them in place."""
    out: list[Blob] = []
    for t in sorted(infos, key=lambda t: (t.path, t.offset)):
        last = out[-1] if out else None
        if last is not None and last.path == t.path and 0 <= t.offset - (last.offset + last.nbytes) <= gap:
            out[-1] = Blob(last.path, last.offset, max(last.nbytes, t.offset + t.nbytes - last.offset),
                           (*last.tensors, t))
        else:
            out.append(Blob(t.path, t.offset, t.nbytes, (t,)))
    return out


def tensor_in(blob: Blob, info: TensorInfo, data: Any) -> torch.Tensor:
    """Tensor `info` as a view of `data` (the blob's bytes, uint8)."""
    at = info.offset - blob.offset
    raw = data[at:at + info.nbytes]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.dtype, device=data.device)
    return raw.view(info.dtype).view(info.shape)


def crc_error(blob: Blob) -> StoreError:
    """The error for a blob whose bytes do not match its CRC-32."""
    names = ", ".join(repr(t.name) for t in blob.tensors[:3]) + (", ..." if len(blob.tensors) > 3 else "")
    return StoreError(f"CRC-32 mismatch reading {blob.nbytes} bytes at offset {blob.offset} of {blob.path} "
                      f"(tensors {names}): the store's file changed or is damaged")


def check(blob: Blob, data: Any) -> None:
    """Raise crc_error(blob) when the store keeps a CRC-32 of `blob` and `data` (its bytes) differ."""
    if blob.crc is not None and crc32(data.numpy()) != blob.crc:
        raise crc_error(blob)


def lease_bytes(blobs: list[Blob]) -> int:
    """Pool bytes a lease of `blobs` takes: each read widened to whole pages around it."""
    return sum(round_up(round_up(b.offset + b.nbytes) - b.offset // PAGE * PAGE) for b in blobs)
