"""deepnvme's own store, the reading side: `OwnStore` opens a store directory written by own_write.py
(the format: own_format.py), checks every claim of its manifest, and gives a unit's tensors as one blob (one
page-aligned request) with its CRC-32."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from deepnvme.offload._doors import open_regular
from deepnvme.offload.stores.own_format import DTYPES, FORMAT, MANIFEST, VERSION
from deepnvme.offload.stores.protocol import Blob, StoreError, TensorInfo


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
    """The store written by write_store in `path` (see own_format.py and protocol.py)."""

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
        dtype = DTYPES.get(e.get("dtype")) if isinstance(e.get("dtype"), str) else None
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


__all__ = ["OwnStore"]
