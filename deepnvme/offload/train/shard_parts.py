"""The memory of an FSDP2 unit's shards (its parameters', or its gradients') and its place on the drive.

FSDP2 keeps each parameter's shard in a storage of its own (the padded shard) and lays a unit's sharded
gradients out in storages it allocates at each backward. A `Parts` is such a set of storages, laid out
one after another at page boundaries in one unit of the swap space, so that the set moves in one request.

Released, a storage's memory is given back to the system, and the storage shows instead a shared mapping
of its own bytes in the swap file: any code that reads or writes the tensor between uses (a gradient
clipped by its norm, a state_dict taken, a parameter printed) sees the values it would see in memory,
read from the file through the page cache, and what it writes goes to the file. A storage shrunk to no
bytes, as FSDP2 frees its gathered parameters, would instead crash the process on the first such read.
The mapping is made only once the unit's write has completed (before it, the page cache could be filled
from the file's previous bytes). Brought back, the bytes come from a read of the unit into the pool
(O_DIRECT, checked against the CRC-32 they were written with) unless the mapping was used meanwhile: then
from the mapping itself, which holds what that code wrote; the unit is then written again at its next
release, so that the drive and its checksum follow.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from deepnvme.offload.swap import Lease, SwapSpace, Unit, round_up

#: torch can point a storage at other memory (where it cannot, shards are not offloaded: refused).
CAN_MAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
_LIBC = ctypes.CDLL(None, use_errno=True)
_PAGE = mmap.PAGESIZE


def storages_of(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages (with bytes) `tensors` lie in, in order of first appearance."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() > 0:
            seen.setdefault(st.data_ptr(), st)
    return list(seen.values())


def _bytes(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(st)


def _touched(st: torch.UntypedStorage) -> bool:
    """Whether any page of the file mapping `st` shows is in the page cache: the mapping was read or
    written since the unit's O_DIRECT write (which leaves no page of its range cached)."""
    length = round_up(st.nbytes())
    vec = (ctypes.c_ubyte * (length // _PAGE))()
    if _LIBC.mincore(ctypes.c_void_p(st.data_ptr()), ctypes.c_size_t(length), vec) != 0:
        return True  # cannot tell: take the mapping's bytes, which are right either way
    return any(b & 1 for b in vec)


class Parts:
    """Storages laid out in one swap unit (`unit`, made by `place`), each resident or showing its mapping."""

    def __init__(self, name: str, storages: Sequence[torch.UntypedStorage]) -> None:
        self.name = name
        self.storages = list(storages)
        self.sizes = [st.nbytes() for st in self.storages]
        self.at: list[int] = []
        end = 0
        for n in self.sizes:
            self.at.append(end)
            end += round_up(n)
        self.nbytes = end
        self.unit: Unit | None = None
        self.maps: list[mmap.mmap | None] = [None] * len(self.storages)
        self.dirty = True  # the drive does not hold these values yet
        self.reading: Lease | None = None  # a read of the unit issued ahead, not yet taken

    @property
    def resident(self) -> bool:
        return all(m is None for m in self.maps)

    def place(self, space: SwapSpace, unit: Unit | None) -> Unit:
        """The swap unit the parts live in: `unit` when it is large enough, else a new one (`unit`'s range
        given back)."""
        if unit is not None and unit.nbytes >= self.nbytes:
            self.unit = unit
            return unit
        if unit is not None:
            space.remove(unit)
        self.unit = space.add(self.name, max(self.nbytes, 1))
        return self.unit

    def write(self, space: SwapSpace) -> Lease:
        """Copy the (resident) bytes into pool memory and queue their write; the lease is done once
        written. The storages stay resident until map() after it."""
        lease = space.allocate([self.unit])  # type: ignore[list-item]
        dest = lease.view(self.unit)  # type: ignore[arg-type]
        for st, at, n in zip(self.storages, self.at, self.sizes):
            dest[at:at + n].copy_(_bytes(st))
        lease.write_back()
        self.dirty = False
        return lease

    def map(self, fd: int) -> None:
        """Give the storages' memory back: each shows its bytes' mapping in the swap file (written)."""
        for i, (st, at, n) in enumerate(zip(self.storages, self.at, self.sizes)):
            if self.maps[i] is not None:
                continue
            mm = mmap.mmap(fd, round_up(n), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=self.unit.io_start + at)  # type: ignore[union-attr]
            shown = torch.frombuffer(mm, dtype=torch.uint8, count=n)
            st._swap_data_ptr_(shown.untyped_storage())  # the storage shows the mapping; `shown`, the memory
            self.maps[i] = mm
            del shown  # frees the memory the storage had

    def touched(self) -> bool:
        """Whether code read or wrote a storage through its mapping since it was mapped."""
        return any(m is not None and _touched(st) for st, m in zip(self.storages, self.maps))

    def fill(self, lease: Lease | None, fd: int) -> None:
        """Make every storage resident again, from `lease` (the unit read into the pool, checked) or, when
        None, from its mapping. A storage already resident is left as it is."""
        src = None if lease is None else lease.view(self.unit)  # type: ignore[arg-type]
        for i, (st, at, n) in enumerate(zip(self.storages, self.at, self.sizes)):
            mm = self.maps[i]
            if mm is None:
                continue
            fresh = torch.empty(n, dtype=torch.uint8)
            fresh.copy_(_bytes(st) if src is None else src[at:at + n])
            st._swap_data_ptr_(fresh.untyped_storage())
            self.maps[i] = None
            del fresh  # drops the mapping's last user
            if src is None:  # what was written through the mapping is in the page cache: to the file,
                mm.flush()  # then out of the cache (it counts in the process's memory until then)
                self.dirty = True
            _close(mm)
            if src is None:
                os.posix_fadvise(fd, self.unit.io_start + at, round_up(n),  # type: ignore[union-attr]
                                 os.POSIX_FADV_DONTNEED)

    def forget(self) -> None:
        """Let the storages go without reading anything (a gradient set to None): a storage still showing
        its mapping keeps it, and it is unmapped when the last tensor over it goes."""
        self.storages, self.maps = [], []
        self.drop_reading()

    def drop_reading(self) -> None:
        """Give back the memory of a read issued ahead and not taken."""
        if self.reading is not None:
            self.reading.release()
            self.reading = None


def _close(mm: Any) -> None:
    try:
        mm.close()
    except BufferError:  # a tensor made from the storage's bytes outlives it: the mapping goes with it
        pass
