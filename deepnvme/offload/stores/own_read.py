"""deepnvme's own weight store: one aligned, contiguous blob per unit in one file, and a JSON manifest.

Why a store of its own when safetensors checkpoints can be read in place: there a unit's tensors may be
spread over shards and lie at unaligned offsets, so a unit takes several requests with partial pages at
their edges; here a unit is one page-aligned request, and every blob and tensor carries a CRC-32
(deepnvme._core.crc) checked as it is read, so a damaged or replaced file is an error, not wrong output.

Layout of a store directory: `manifest.json` and `weights-<id>.bin`. In the file, each unit's tensors are
back to back (each at a multiple of 64 bytes) in one blob that starts at a page boundary; tensors outside
every unit form one more blob (unit ""). Tensors that are one tensor under several names (tied weights)
are written once and listed under each name. The manifest is replaced last and atomically
(deepnvme._core.files), after the weights file is complete and synced, so a store is either the old one
or the new one; the old weights file is then removed.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from deepnvme.offload._doors import atomic_target, crc32, open_regular, write_atomically
from deepnvme.offload.model_map import tensor_aliases, unit_names
from deepnvme.offload.pool import round_up
from deepnvme.offload.store import Blob, StoreError, TensorInfo, runs

MANIFEST = "manifest.json"
FORMAT = "deepnvme-weights"
VERSION = 1
TENSOR_ALIGN = 64
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64, torch.complex128)}


def _default_units(names: Iterable[str]) -> list[str]:
    """Unit prefixes of a state dict: `<list>.<i>` for the list of numbered blocks with the most tensors."""
    counts: dict[str, set[str]] = {}
    for n in names:
        m = re.match(r"^(.*?)\.(\d+)\.", n)
        if m:
            counts.setdefault(m[1], set()).add(f"{m[1]}.{m[2]}")
    if not counts:
        return []
    best = max(counts, key=lambda k: len(counts[k]))
    return sorted(counts[best], key=lambda u: int(u.rsplit(".", 1)[1]))


def _named_tensors(obj: nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
    """(names, tensor) of each distinct tensor: tied ones once, under all their names."""
    if isinstance(obj, nn.Module):
        return [(names, t) for names, t in tensor_aliases(obj)]
    if not isinstance(obj, Mapping):
        raise TypeError(f"write_store takes a torch.nn.Module or a state dict, got {type(obj).__name__}")
    seen: dict[tuple, int] = {}
    out: list[tuple[list[str], torch.Tensor]] = []
    for name, t in obj.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape),
               t.stride()) if not t.is_meta and t.numel() else None
        if key is not None and key in seen:
            out[seen[key]][0].append(name)
            continue
        if key is not None:
            seen[key] = len(out)
        out.append(([name], t))
    return out


def write_store(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], directory: str | os.PathLike, *,
                units: list[str] | None = None) -> str:
    """Write the tensors of a model (or a state dict) as a deepnvme store in `directory` (created if
    needed; a store there is replaced atomically). `units`: the unit prefixes (module names such as
    "model.layers.3"; a tensor belongs to the longest prefix it starts with); by default a model's
    repeated blocks (as stream_weights picks them) or, for a state dict, the numbered blocks with the most
    tensors. Returns the directory."""
    directory = os.path.abspath(os.fspath(directory))
    tensors = _named_tensors(model_or_state_dict)
    for names, t in tensors:
        if t.is_meta:
            raise ValueError(f"tensor {names[0]!r} is on the meta device: it has no values to write")
    if units is None:
        if isinstance(model_or_state_dict, nn.Module):
            units = unit_names(model_or_state_dict)
        else:
            units = _default_units(n for names, _ in tensors for n in names)
    if isinstance(model_or_state_dict, nn.Module):  # every expert a blob of its own (expert_sets.py)
        from deepnvme.offload.expert_sets import expert_unit_names, split_fused

        tensors = split_fused(model_or_state_dict, tensors)
        units = [*units, *expert_unit_names(model_or_state_dict)]
    prefixes = sorted(set(units), key=len, reverse=True)
    groups: dict[str, list[tuple[list[str], torch.Tensor]]] = {u: [] for u in [*units, ""]}
    for names, t in tensors:
        home = next((u for u in prefixes if names[0] == u or names[0].startswith(u + ".")), "")
        groups[home].append((names, t))
    os.makedirs(directory, exist_ok=True)
    old = _old_weights(directory)
    file = f"weights-{uuid.uuid4().hex[:12]}.bin"
    path = os.path.join(directory, file)
    manifest_blobs = []
    with atomic_target(path) as tmp, open(tmp, "wb") as f:
        at = 0
        for unit, members in groups.items():
            if not members:
                continue
            start = round_up(at)
            f.write(bytes(start - at))
            at, blob_crc, entries = start, 0, []
            for names, t in members:
                pad = round_up(at, TENSOR_ALIGN) - at
                if pad and at > start:
                    f.write(bytes(pad))
                    blob_crc = crc32(bytes(pad), blob_crc)
                    at += pad
                data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(data)
                c = crc32(data)
                blob_crc = crc32(data, blob_crc)
                entries.append({"names": names, "offset": at, "nbytes": int(data.nbytes),
                                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                "crc": c})
                at += data.nbytes
            manifest_blobs.append({"unit": unit, "offset": start, "nbytes": at - start, "crc": blob_crc,
                                   "tensors": entries})
        f.write(bytes(round_up(at) - at))  # whole pages: the last blob's read needs no partial page
        f.flush()
        os.fsync(f.fileno())
    manifest = {"format": FORMAT, "version": VERSION, "file": file, "file_bytes": round_up(at),
                "blobs": manifest_blobs}
    write_atomically(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1).encode())
    if old is not None and old != file:
        try:
            os.unlink(os.path.join(directory, old))
        except FileNotFoundError:
            pass
    return directory


def _old_weights(directory: str) -> str | None:
    """The weights file the store in `directory` names, to remove once replaced (None: no store there, or
    an unreadable manifest that is simply replaced). A manifest path that is not a regular file (a FIFO)
    is refused, naming it, rather than waited on or replaced."""
    try:
        fd = open_regular(os.path.join(directory, MANIFEST))
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            name = json.loads(f.read()).get("file")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and "/" not in name else None


def _count(entry: dict, key: str, where: str) -> int:
    """entry[key] as a non-negative int (a byte offset, a length, a CRC), else a StoreError naming it."""
    v = entry.get(key)
    if type(v) is not int or v < 0:
        raise StoreError(f"{where}: {key!r} is {v!r}, not a non-negative integer")
    return v


def _no_overlap(spans: list[tuple[int, int, str]], manifest_path: str, what: str) -> None:
    """Refuse (start, end, name) byte ranges, sorted, of which two overlap: two tensors (or blobs) read
    from the same bytes would give wrong values silently."""
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise StoreError(f"{manifest_path}: {what} {a} and {b} overlap in the weights file")


class OwnStore:
    """The store written by write_store in `path` (see the module and store.py)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        manifest_path = os.path.join(self.path, MANIFEST)
        try:
            with os.fdopen(open_regular(manifest_path), "rb") as f:  # a FIFO is refused, not waited on
                m = json.loads(f.read())
        except ValueError as exc:
            raise StoreError(f"{manifest_path}: not a readable deepnvme store manifest ({exc})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
            raise StoreError(f"{manifest_path}: not a deepnvme store manifest of version {VERSION}")
        file = m.get("file")
        if not isinstance(file, str) or "/" in file:
            raise StoreError(f"{manifest_path}: 'file' must name the weights file in the store directory")
        self.file = os.path.join(self.path, file)
        try:
            fd = open_regular(self.file)  # a FIFO is refused, not waited on by the reads later
        except FileNotFoundError:
            raise FileNotFoundError(2, "the store's weights file is missing", self.file) from None
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        self._tensors: dict[str, TensorInfo] = {}
        self._blobs: list[Blob] = []
        self._crc: dict[str, int] = {}
        blobs = m.get("blobs", [])
        if not isinstance(blobs, list):
            raise StoreError(f"{manifest_path}: 'blobs' is a {type(blobs).__name__}, not a list")
        spans: list[tuple[int, int, str]] = []
        for i, b in enumerate(blobs):
            unit = b.get("unit") if isinstance(b, dict) else None
            where = f"{manifest_path}: blob {i} (unit {unit!r})"
            if not isinstance(b, dict):
                raise StoreError(f"{where}: is a {type(b).__name__}, not an object")
            offset, nbytes = _count(b, "offset", where), _count(b, "nbytes", where)
            crc = _count(b, "crc", where)
            entries = b.get("tensors")
            if not isinstance(entries, list):
                raise StoreError(f"{where}: 'tensors' is missing or not a list")
            infos: list[TensorInfo] = []
            inside: list[tuple[int, int, str]] = []
            for e in entries:
                aliases = self._entry(e, offset, nbytes, manifest_path, where)
                infos.extend(aliases)
                t = aliases[0]  # the names of one entry are one tensor (tied weights)
                if t.nbytes:
                    inside.append((t.offset, t.offset + t.nbytes, repr(t.name)))
            _no_overlap(sorted(inside), manifest_path, "tensors")
            if offset + nbytes > size:
                cut = next((t.name for t in infos if t.offset + t.nbytes > size), None)
                what = f"tensor {cut!r}'s data" if cut is not None else "its blob"
                raise StoreError(f"{where}: {what} ends past byte {size}, the end of {self.file}: the file "
                                 "is truncated")
            spans.append((offset, offset + nbytes, f"unit {unit!r}"))
            self._blobs.append(Blob(self.file, offset, nbytes, tuple(infos), crc))
        _no_overlap(sorted(s for s in spans if s[0] < s[1]), manifest_path, "blobs")

    def _entry(self, e: Any, blob_offset: int, blob_nbytes: int, manifest_path: str,
               blob_where: str) -> list[TensorInfo]:
        """The TensorInfo of each name of manifest entry `e` (of the blob at `blob_offset`), every claim
        checked: names, dtype, shape, offset and nbytes inside the blob, nbytes = numel * itemsize."""
        if not isinstance(e, dict):
            raise StoreError(f"{blob_where}: a tensor entry is a {type(e).__name__}, not an object")
        names = e.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise StoreError(f"{blob_where}: a tensor entry's 'names' {names!r} is not a list of names")
        where = f"tensor {names[0]!r} in {manifest_path}"
        dtype = _DTYPES.get(e.get("dtype")) if isinstance(e.get("dtype"), str) else None
        if dtype is None:
            raise StoreError(f"{where}: unknown dtype {e.get('dtype')!r} in the manifest")
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise StoreError(f"{where}: 'shape' {shape!r} is not a list of non-negative integers")
        offset, nbytes, crc = _count(e, "offset", where), _count(e, "nbytes", where), _count(e, "crc", where)
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != nbytes:
            raise StoreError(f"{where}: the manifest gives {nbytes} bytes for {e['dtype']} {tuple(shape)}, "
                             f"which takes {numel * dtype.itemsize}")
        if not blob_offset <= offset <= offset + nbytes <= blob_offset + blob_nbytes:
            raise StoreError(f"{where}: bytes {offset}..{offset + nbytes} lie outside its blob (bytes "
                             f"{blob_offset}..{blob_offset + blob_nbytes} of {self.file})")
        out = []
        for n in names:
            if n in self._tensors:
                raise StoreError(f"tensor {n!r} is listed twice in {manifest_path}")
            info = TensorInfo(n, self.file, offset, nbytes, dtype, tuple(shape))
            self._tensors[n] = info
            self._crc[n] = crc
            out.append(info)
        return out

    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._tensors

    def blobs(self, names: Iterable[str]) -> list[Blob]:
        """A unit's blob where `names` hold every tensor of it (one request, its CRC checked); any other
        tensor read on its own with its own CRC."""
        want = set()
        for n in names:
            if n not in self._tensors:
                raise KeyError(f"tensor {n!r} is not in the deepnvme store {self.path}")
            want.add(n)
        out = []
        for b in self._blobs:
            members = {t.name for t in b.tensors}
            if members and members <= want:
                out.append(b)
                want -= members
        by_place: dict[tuple[int, int], list[TensorInfo]] = {}
        for n in sorted(want):
            info = self._tensors[n]
            by_place.setdefault((info.offset, info.nbytes), []).append(info)
        for (offset, nbytes), infos in sorted(by_place.items()):
            out.append(Blob(self.file, offset, nbytes, tuple(infos), self._crc[infos[0].name]))
        return out

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"OwnStore({self.path!r}, {len(self._tensors)} tensors)"


__all__ = ["MANIFEST", "OwnStore", "runs", "write_store"]
