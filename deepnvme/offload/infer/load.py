"""Whole tensors read from a store into tensors of their own, at disk speed, through a swap space's pool.

Why through the pool and not straight into the destinations: O_DIRECT needs page-aligned memory and
offsets, and a tensor's memory from the allocator is neither; a locked pool buffer is. The store's blobs
are cut into chunks of at most a quarter of the pool, read ahead in order (ReadAhead: the next chunks are
on the drive while this one is copied out), and each chunk's bytes are copied into the tensors they
belong to (to a CUDA device straight from the locked buffer). CRC-32s the store keeps are checked as the
bytes pass (stores.check). Used by load_safetensors, and by stream_weights for the tensors outside units.

Why a load to the CPU also copies through the pool rather than reading each tensor O_DIRECT into its own
new storage: a new storage's pages are made by whoever touches them first, and on a machine where that is
costly (a VM faulting in fresh memory) the O_DIRECT reads make them one request at a time while the copy
out of the pool makes them beside the next reads; bench/stream_bench.py's load section compares the two.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch

from deepnvme.offload._doors import crc32
from deepnvme.offload.stores import Blob, SafetensorsStore, Store, TensorInfo, crc_error, lease_bytes
from deepnvme.offload.swap import ReadAhead, SwapSpace, budget_arg

_names = itertools.count()


@dataclass
class _Chunk:
    blob: Blob
    path: str
    offset: int
    nbytes: int
    parts: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (dest bytes, at, n)
    ends: list[Blob] = field(default_factory=list)  # blobs whose last bytes are in this chunk


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def _chunks(blobs: list[Blob], dests: dict[str, torch.Tensor], chunk: int) -> list[_Chunk]:
    out: list[_Chunk] = []
    for blob in blobs:
        start = 0
        pieces: list[_Chunk] = []
        while start < blob.nbytes or not pieces:
            n = min(chunk, blob.nbytes - start)
            pieces.append(_Chunk(blob, blob.path, blob.offset + start, max(n, 0)))
            start += n
            if n <= 0:
                break
        for info in blob.tensors:
            dest = _byte_view(dests[info.name])
            lo, hi = info.offset - blob.offset, info.offset - blob.offset + info.nbytes
            for p in pieces:
                a, b = max(lo, p.offset - blob.offset), min(hi, p.offset - blob.offset + p.nbytes)
                if a < b:
                    p.parts.append((dest[a - lo:b - lo], a - (p.offset - blob.offset), b - a))
        pieces[-1].ends.append(blob)
        out.extend(p for p in pieces if p.nbytes > 0 or p.ends)
    return out


def read_into(space: SwapSpace, store: Store, dests: dict[str, torch.Tensor]) -> int:
    """Fill each tensor of `dests` (name -> tensor of the store's dtype and shape, contiguous, any device)
    with its bytes from `store`; returns the bytes read."""
    blobs = store.blobs(list(dests))
    chunks = _chunks(blobs, dests, max(space.pool.capacity // 4, 1 << 12))
    for c in chunks:  # a chunk at an unaligned offset is read as whole pages around it
        need = lease_bytes([Blob(c.path, c.offset, c.nbytes)]) if c.nbytes else 0
        if need > space.pool.capacity:
            t = next((t for t in c.blob.tensors if t.offset + t.nbytes > c.offset), c.blob.tensors[0])
            raise ValueError(f"tensor {t.name!r} in {c.path} is read in pieces of whole pages taking up to "
                             f"{need} bytes, over budget_bytes={space.pool.capacity}: raise budget_bytes to "
                             f"at least {need}")
    units = [[space.add_external(f"bulk-{next(_names)}", c.path, c.offset, c.nbytes)] if c.nbytes else []
             for c in chunks]
    reader = ReadAhead(space, units)
    crcs = {id(b): 0 for b in blobs}
    total = 0
    try:
        for i, c in enumerate(chunks):
            lease = reader.take(i)
            try:
                data = lease.view(units[i][0]) if lease is not None else None
                cuda = False
                for dest, at, n in c.parts:
                    dest.copy_(data[at:at + n], non_blocking=dest.is_cuda)
                    cuda = cuda or dest.is_cuda
                if data is not None:
                    total += c.nbytes
                    if c.blob.crc is not None:
                        crcs[id(c.blob)] = crc32(data.numpy(), crcs[id(c.blob)])
                if cuda:
                    torch.cuda.synchronize()  # the locked buffer is reused once the copies have finished
            finally:
                if lease is not None:
                    lease.release()
            for b in c.ends:
                if b.crc is not None and crcs[id(b)] != b.crc:
                    raise crc_error(b)
    finally:
        reader.close()
    return total


def empty_like_info(info: TensorInfo, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of `info`'s dtype and shape on `device`."""
    return torch.empty(info.shape, dtype=info.dtype, device=device)


def read_store(store: Store, names: list[str], device: torch.device,
               budget_bytes: int) -> dict[str, torch.Tensor]:
    """New tensors on `device` holding `names` of `store` (see read_into), through a read-only swap space
    of `budget_bytes` made for the purpose."""
    infos = store.tensors()
    for n in names:
        if n not in infos:
            raise KeyError(f"tensor {n!r} is not in the store {store.path}")
    dests = {n: empty_like_info(infos[n], device) for n in names}
    with SwapSpace(None, budget_bytes) as space:
        read_into(space, store, dests)
    return dests


def load_safetensors(path: str | os.PathLike, device: str | torch.device = "cpu", *,
                     budget_bytes: int = 64 << 20) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint at `path` (file or directory, sharded or not), as a new
    tensor (a storage of its own) on `device`, read at disk speed with no page cache: large O_DIRECT reads
    through `budget_bytes` of locked memory (two requests in flight), copied into the destination tensors
    as each lands."""
    budget_bytes = budget_arg(budget_bytes)
    store = SafetensorsStore(path)
    return read_store(store, list(store.tensors()), torch.device(device), budget_bytes)
