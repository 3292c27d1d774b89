"""A byte-budgeted pool of locked, page-aligned host memory carved out of one allocation.

Every buffer the swap space reads into or writes from comes from here, so the locked memory of offload is
exactly the budget, whatever the sizes of the units. Buffers are byte ranges of one locked tensor (made
by the aio handle's `new_cpu_locked_tensor`, so every handle recognises them as locked), handed out first
fit in whole pages and given back in any order; neighbouring free ranges merge. `acquire` can wait for
space (another thread's write-back gives it back) or return None at once (a prefetch that must not block).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

from deepnvme.offload._doors import PAGE, round_up  # round_up: _core's, which offload's modules import here


class PoolClosedError(RuntimeError):
    """The pool was closed while a caller waited for space."""


class Buffer:
    """A page-aligned byte range of the pool: `tensor` is a uint8 view of `nbytes` (whole pages)."""

    __slots__ = ("nbytes", "pool", "start", "tensor")

    def __init__(self, pool: BufferPool, start: int, nbytes: int, tensor: Any) -> None:
        self.pool, self.start, self.nbytes, self.tensor = pool, start, nbytes, tensor

    def release(self) -> None:
        """Give the range back (idempotent)."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool._give_back(self.start, self.nbytes)


class BufferPool:
    """`budget_bytes` (rounded down to whole pages) of locked memory, allocated once.

    `handle` is any aio handle (its `new_cpu_locked_tensor` allocates, locks and registers the memory).
    """

    def __init__(self, budget_bytes: int, handle: Any) -> None:
        import torch

        capacity = budget_bytes // PAGE * PAGE
        if capacity <= 0:
            raise ValueError(f"budget_bytes={budget_bytes} is less than one page ({PAGE} bytes)")
        self.capacity = capacity
        self._handle = handle
        self._memory = handle.new_cpu_locked_tensor(capacity, torch.empty(0, dtype=torch.uint8))
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (start, size), sorted by start, merged
        self._cond = threading.Condition()
        self._closed = False
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def memory(self) -> Any:
        """The whole locked allocation (a uint8 tensor), e.g. to register it with CUDA."""
        if self._memory is None:
            raise PoolClosedError("the buffer pool is closed")
        return self._memory

    def acquire(self, nbytes: int, block: bool = True, *,
                within: tuple[int, int] | None = None) -> Buffer | None:
        """A buffer of at least `nbytes` (whole pages); waits for space when `block`, else None if none.
        `within` (start, end): byte offsets of the pool where the buffer should lie if a free range there
        has room (else first fit anywhere): the expert cache keeps a layer's experts in address order."""
        size = round_up(max(nbytes, 1))
        if size > self.capacity:
            raise ValueError(f"a buffer of {nbytes} bytes cannot come from a pool of {self.capacity} bytes; "
                             f"raise budget_bytes to at least {size}")
        with self._cond:
            while True:
                if self._closed:
                    raise PoolClosedError("the buffer pool is closed")
                start = self._take_within(size, *within) if within is not None else None
                if start is None:
                    start = self._take(size)
                if start is not None:
                    break
                if not block:
                    return None
                self._cond.wait()
            self.in_use += size
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return Buffer(self, start, size, self._memory[start:start + size])

    def _take(self, size: int) -> int | None:
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                return start
        return None

    def _take_within(self, size: int, lo: int, hi: int) -> int | None:
        for i, (start, free) in enumerate(self._free):
            at = max(start, lo)
            if at + size <= min(start + free, hi):
                pieces = [(start, at - start), (at + size, start + free - at - size)]
                self._free[i:i + 1] = [p for p in pieces if p[1] > 0]
                return at
        return None

    def _give_back(self, start: int, size: int) -> None:
        with self._cond:
            i = bisect.bisect(self._free, (start, size))
            self._free.insert(i, (start, size))
            # Merge with the right neighbour, then the left one.
            if i + 1 < len(self._free) and start + size == self._free[i + 1][0]:
                self._free[i] = (start, size + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free.pop(i)[1])
            self.in_use -= size
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter (they raise PoolClosedError) and unlock the memory now; it is freed once the
        last view of it is gone (so a view kept by mistake never dangles)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._memory is not None:
            self._handle.free_cpu_locked_tensor(self._memory)
            self._memory = None
            self._handle = None  # its descriptors close now
