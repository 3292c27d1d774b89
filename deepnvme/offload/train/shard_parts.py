"""The memory of an FSDP2 unit's shards (its parameters', or its gradients') and its place on the drive.

FSDP2 keeps each parameter's shard in a storage of its own (the padded shard) and lays a unit's sharded
gradients out in storages it allocates at each backward. A `Parts` is such a set of storages, laid out
one after another at page boundaries in one unit of the swap space, so that the set moves in one request.

Released, the storages' memory is given back to the system, and each storage shows instead its bytes in
one private mapping of the unit's range of the swap file (copy-on-write): any code that reads or writes
the tensor between uses (a gradient clipped by its norm, a state_dict taken, a parameter printed) sees the
values it would see in memory, read from the file through the page cache; what it writes stays in its
own pages of the mapping. A storage shrunk to no bytes, as FSDP2 frees its gathered parameters, would
instead crash the process on the first such read. The mapping is made only once the unit's write has
completed. Brought back, the bytes come from a read of the unit into the pool (O_DIRECT, checked against
the CRC-32 they were written with) unless a page of the mapping was written meanwhile (the kernel's page
map says which pages became the process's own): then from the mapping itself, and the unit is written
again at its next release, so that the drive and its checksum follow. Bytes changed in the file by anyone
else are caught by the checksum either way.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from deepnvme.offload.swap import Lease, SwapSpace, Unit, round_up

#: torch can point a storage at other memory (where it cannot, shards are not offloaded: refused).
CAN_MAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
_PAGE = mmap.PAGESIZE
# Bits of a /proc/self/pagemap entry: swapped out, file-backed (or shared); bit 63, present, is the sign bit
# of the entry read as an int64.
_SWAPPED, _FILE = 1 << 62, 1 << 61


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


def _written(address: int, length: int) -> bool:
    """Whether a page of the private file mapping at `address` became the process's own (written: present
    and no longer the file's page, or swapped out), by the kernel's page map."""
    first, count = address // _PAGE, -(-length // _PAGE)
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            data = os.pread(f.fileno(), 8 * count, 8 * first)
    except OSError:
        return True  # cannot tell: take the mapping's bytes, which are right either way
    if len(data) != 8 * count:
        return True
    entries = torch.frombuffer(bytearray(data), dtype=torch.int64)
    own = (entries < 0) & ((entries & _FILE) == 0)
    return bool(own.any()) or bool(((entries & _SWAPPED) != 0).any())


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
        self.mm: mmap.mmap | None = None  # the mapping the storages show while released
        self.dirty = True  # the drive does not hold these values yet
        self.reading: Lease | None = None  # a read of the unit issued ahead, not yet taken
        self.stamp: list[int] | None = None  # the tensors' versions when brought (in-place writes since)

    @property
    def resident(self) -> bool:
        return self.mm is None

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

    def write(self, space: SwapSpace, make_room: Callable[[], None]) -> Lease:
        """Copy the (resident) bytes into pool memory and queue their write; the lease is done once
        written. The storages stay resident until map() after it. When the pool is full, `make_room()`
        gives back what only this thread would (reads issued ahead) before waiting for the rest (writes,
        which complete on their own)."""
        lease = space.allocate([self.unit], block=False)  # type: ignore[list-item]
        if lease is None:
            make_room()
            lease = space.allocate([self.unit])  # type: ignore[list-item]
        dest = lease.view(self.unit)  # type: ignore[arg-type]
        for st, at, n in zip(self.storages, self.at, self.sizes):
            dest[at:at + n].copy_(_bytes(st))
        lease.write_back()
        self.dirty = False
        return lease

    def map(self, fd: int) -> None:
        """Give the storages' memory back: each shows its bytes in a private mapping of the unit's range
        (written: its write is done)."""
        if self.mm is not None or not self.storages:
            return
        mm = mmap.mmap(fd, self.nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=self.unit.io_start)  # type: ignore[union-attr]
        self.mm = mm
        for st, at, n in zip(self.storages, self.at, self.sizes):
            shown = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=at)
            st._swap_data_ptr_(shown.untyped_storage())  # the storage shows the mapping; `shown`, the memory
            del shown  # frees the memory the storage had

    def written(self) -> bool:
        """Whether code wrote a storage through the mapping since it was mapped."""
        if self.mm is None:
            return False
        return _written(self.storages[0].data_ptr(), self.nbytes)

    def fill(self, lease: Lease | None) -> None:
        """Make every storage resident again, from `lease` (the unit read into the pool, checked) or, when
        None, from the mapping (which holds what was written through it)."""
        if self.mm is None:
            return
        src = None if lease is None else lease.view(self.unit)  # type: ignore[arg-type]
        for st, at, n in zip(self.storages, self.at, self.sizes):
            fresh = torch.empty(n, dtype=torch.uint8)
            fresh.copy_(_bytes(st) if src is None else src[at:at + n])
            st._swap_data_ptr_(fresh.untyped_storage())
            del fresh  # drops a user of the mapping
        if src is None:
            self.dirty = True  # the drive's bytes are not these
        _close(self.mm)
        self.mm = None

    def shared(self) -> bool:
        """Whether a storage is held by anything but this (a tensor over it: a gradient someone kept)."""
        return any(torch._C._storage_Use_Count(st._cdata) > 1 for st in self.storages)

    def forget(self) -> None:
        """Let the storages go without reading anything (a gradient set to None): a storage still showing
        the mapping keeps it, and it is unmapped when the last tensor over it goes."""
        self.storages, self.mm = [], None
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
