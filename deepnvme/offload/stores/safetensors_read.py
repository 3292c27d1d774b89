"""A Hugging Face safetensors checkpoint as a store (protocol.py), read in place: one file or sharded.

The format: 8 bytes of little-endian header length, a JSON header (per tensor: dtype, shape, data_offsets
relative to the end of the header), then the data. Sharded checkpoints have `model.safetensors.index.json`
whose `weight_map` names each tensor's shard. Only headers are read when the store opens; every claim in
them is checked then, so that a lying or cut header is an error naming the tensor and the file instead of
a read of the wrong bytes later: a dtype safetensors does not define, a shape that is not a list of
non-negative integers, offsets whose length is not the shape's bytes, offsets that overlap another
tensor's, data past the end of the file (a truncated download), a tensor the index places in a shard
that does not hold it.

Nothing is rewritten: the tensors are read from where they are (through the swap space's external units,
O_DIRECT where the file system allows, the unaligned edges read as part of whole pages).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from deepnvme.offload._doors import open_regular
from deepnvme.offload.stores.own_format import MANIFEST
from deepnvme.offload.stores.protocol import Blob, StoreError, TensorInfo, runs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A header bigger than this is not a header (safetensors itself refuses 100 MB).
MAX_HEADER = 100 << 20

# Every dtype safetensors defines (its format's names), with the torch dtype it is read as: None where this
# torch has none (an error names the dtype and the torch version).
_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
    "U32": "uint32", "U64": "uint64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}
DTYPES: dict[str, torch.dtype | None] = {k: getattr(torch, v, None) for k, v in _NAMES.items()}
# Header elements per element of the torch dtype: F4 counts 4-bit values, torch packs two in a byte (the
# last dimension is halved).
PACKED = {"F4": 2}


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, every claim of its header checked (see the module)."""
    try:
        fd = open_regular(path)  # a FIFO or a device is refused, never waited on
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror}: cannot read the safetensors header", path) from exc
    try:
        size = os.fstat(fd).st_size
        # No read-ahead: the kernel would otherwise bring the first tensors into the page cache with the
        # header, and the tensors are read with O_DIRECT.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise StoreError(f"{path}: {size} bytes, too short for a safetensors file (no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise StoreError(f"{path}: header length {n} does not fit the file ({size} bytes): not a "
                             "safetensors file, or truncated")
        raw = os.pread(fd, n, 8)
        if len(raw) < n:
            raise StoreError(f"{path}: the header was cut short ({len(raw)} of {n} bytes)")
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror}: cannot read the safetensors header", path) from exc
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path}: the safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise StoreError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, entry, base, size)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out.values() if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise StoreError(f"{path}: tensors {a!r} and {b!r} overlap in the header's data_offsets")
    return out


def _entry(path: str, name: str, entry: Any, base: int, size: int) -> TensorInfo:
    where = f"tensor {name!r} in {path}"
    if not isinstance(entry, dict):
        raise StoreError(f"{where}: header entry is not an object")
    name_of = entry.get("dtype")
    if not isinstance(name_of, str) or name_of not in DTYPES:
        raise StoreError(f"{where}: unknown dtype {name_of!r}")
    dtype = DTYPES[name_of]
    if dtype is None:
        raise StoreError(f"{where}: dtype {name_of} has no torch dtype in torch {torch.__version__} "
                         f"(torch.{_NAMES[name_of]} is missing)")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise StoreError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    pack = PACKED.get(name_of, 1)
    if pack > 1:
        if not shape or shape[-1] % pack:
            raise StoreError(f"{where}: {name_of} packs {pack} values in a byte, but the last dimension of "
                             f"{shape} is not a multiple of {pack}")
        shape = [*shape[:-1], shape[-1] // pack]
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise StoreError(f"{where}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = offsets[1] - offsets[0]
    if nbytes != numel * dtype.itemsize:
        raise StoreError(f"{where}: data_offsets span {nbytes} bytes but {name_of} {entry['shape']} "
                         f"takes {numel * dtype.itemsize}: the header lies about offsets or dtype")
    if base + offsets[1] > size:
        raise StoreError(f"{where}: its data ends at byte {base + offsets[1]} but the file has {size}: "
                         "the file is truncated")
    return TensorInfo(name, path, base + offsets[0], nbytes, dtype, tuple(shape))


def shard_files(path: str) -> list[str]:
    """The safetensors files of the checkpoint at `path` (a file, or a directory with an index or
    model.safetensors), with the index checked against the shards' headers by the caller."""
    if os.path.exists(path) and not os.path.isdir(path):
        return [path]  # read_header refuses what is not a regular file
    if not os.path.isdir(path):
        raise FileNotFoundError(2, "no safetensors checkpoint here (neither a file nor a directory)", path)
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        return sorted({os.path.join(path, f) for f in _weight_map(index).values()})
    single = os.path.join(path, SINGLE)
    if os.path.exists(single):
        return [single]
    if os.path.exists(os.path.join(path, MANIFEST)):
        raise FileNotFoundError(2, f"no {SINGLE} or {INDEX} in this directory: it is a deepnvme store "
                                f"(write_store's {MANIFEST}): stream it with stream_weights(model, path, "
                                "budget_bytes) or open it with open_store(path), not as safetensors", path)
    raise FileNotFoundError(2, f"no {SINGLE}, {INDEX} or deepnvme store manifest in this directory", path)


def _weight_map(index: str) -> dict[str, str]:
    """The index's tensor -> shard map. A FIFO or device named like the index is refused (OSError naming
    it), never waited on."""
    with os.fdopen(open_regular(index), "rb") as f:
        raw = f.read()
    try:
        wm = json.loads(raw).get("weight_map")
    except (ValueError, AttributeError) as exc:
        raise StoreError(f"{index}: not a readable safetensors index ({exc})") from None
    if not isinstance(wm, dict) or not all(isinstance(v, str) and "/" not in v for v in wm.values()):
        raise StoreError(f"{index}: 'weight_map' must map tensor names to shard file names")
    return wm


class SafetensorsStore:
    """The tensors of a safetensors checkpoint at `path`, by name (see the module and protocol.py)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        files = shard_files(self.path)
        self._tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in read_header(file).items():
                if name in self._tensors:
                    raise StoreError(f"tensor {name!r} is in both {self._tensors[name].path} and {file}")
                self._tensors[name] = info
        index = os.path.join(self.path, INDEX)
        if os.path.isdir(self.path) and os.path.exists(index):
            for name, shard in _weight_map(index).items():
                info = self._tensors.get(name)
                want = os.path.join(self.path, shard)
                if info is None or info.path != want:
                    raise StoreError(f"tensor {name!r}: {index} places it in {want}, whose header does not "
                                     "hold it")

    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._tensors

    def blobs(self, names: Iterable[str]) -> list[Blob]:
        infos = []
        for n in names:
            if n not in self._tensors:
                raise KeyError(f"tensor {n!r} is not in the safetensors checkpoint {self.path}")
            infos.append(self._tensors[n])
        return runs(infos)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"SafetensorsStore({self.path!r}, {len(self._tensors)} tensors)"

