"""deepnvme's own store, the writing side (the format: own_format.py): named tensors grouped into units
become one weights file of page-aligned blobs and a manifest, replaced atomically.

Which tensors form which unit is the caller's (deepnvme.offload.infer.prepare.write_store picks units from
a model or a state dict); this module knows only the bytes and the manifest.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping, Sequence

import torch

from deepnvme.offload._doors import atomic_target, crc32, open_regular, write_atomically
from deepnvme.offload.stores.own_format import FORMAT, MANIFEST, TENSOR_ALIGN, VERSION, dtype_name
from deepnvme.offload.swap import round_up


def write_units(directory: str | os.PathLike,
                groups: Mapping[str, Sequence[tuple[list[str], torch.Tensor]]]) -> str:
    """Write a deepnvme store in `directory` (created if needed; a store there is replaced atomically):
    each group (unit name -> its tensors, each with all its names) one blob, in the order given; unit ""
    holds the tensors of no unit. Empty groups write nothing. Returns the directory, absolute."""
    for members in groups.values():  # a dtype no store keeps is refused before anything is written
        for _, t in members:
            dtype_name(t.dtype)
    directory = os.path.abspath(os.fspath(directory))
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
                                "dtype": dtype_name(t.dtype), "shape": list(t.shape),
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
