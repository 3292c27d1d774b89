"""Memory the O_DIRECT paths need: the page size, page-aligned buffers, and raw views of tensor memory; and
how much memory this process may lock.

O_DIRECT transfers need their memory, file offset and length aligned; the page is the unit every common
device accepts, so it is the one alignment the library uses (:data:`PAGE`, :func:`round_up`). Locked
(pinned) memory is bounded by RLIMIT_MEMLOCK unless the process holds CAP_IPC_LOCK
(:func:`has_cap_ipc_lock`, :func:`memlock_limit`): the swap space's preflight and ``deepnvme report`` ask
here.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import resource
import threading
from collections.abc import Sequence
from typing import Any

from deepnvme._core.checks import check_int

__all__ = ["CAP_IPC_LOCK_BIT", "PAGE", "Populator", "address_of", "aligned_buffer", "byte_view",
           "has_cap_ipc_lock", "madvise", "memlock_limit", "memory_of", "round_up"]

PAGE = mmap.PAGESIZE
# CAP_IPC_LOCK's bit in a capability set (linux/capability.h).
CAP_IPC_LOCK_BIT = 14


def round_up(n: int, unit: int = PAGE) -> int:
    """The smallest multiple of ``unit`` that is >= ``n``."""
    return -(-n // unit) * unit


def has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK in its effective set)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK_BIT & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock_limit(soft: int | None = None, privileged: bool | None = None) -> int | None:
    """The bytes this process may lock in all, or None where nothing bounds it: RLIMIT_MEMLOCK's soft limit
    is unlimited, or the process has CAP_IPC_LOCK, which the kernel lets lock past the limit. ``soft`` and
    ``privileged`` default to this process's limit and :func:`has_cap_ipc_lock` (a caller may ask about
    others)."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    if privileged is None:
        privileged = has_cap_ipc_lock()
    return None if privileged else soft


def aligned_buffer(nbytes: int, for_path: str | None = None) -> Any:
    """A page-aligned uint8 tensor of `nbytes` in anonymous memory: usable for O_DIRECT, not locked.

    Locked memory is capped by RLIMIT_MEMLOCK (often 8 MiB), so staging buffers are plain pages. Private
    ones: mmap's default for anonymous memory is shared (shmem), whose pages cost about half as much again
    to fault in, and which a forked child would keep writing into the parent's buffer through. When the
    mapping fails (ENOMEM), the OSError names `for_path`, the file the memory was for: mmap names nothing.
    """
    import torch

    check_int("nbytes", nbytes)
    try:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror} (mapping {nbytes} bytes of memory for it)",
                      for_path) from exc
    return torch.frombuffer(memory, dtype=torch.uint8)


def memory_of(t: Any) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (the caller keeps the tensor alive)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer, to read the address behind a read-only memoryview."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def address_of(view: memoryview) -> int:
    """The address of a buffer's first byte; torch hands its storages to write() as such views."""
    buf = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buf), 0)
    try:
        return buf.buf or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


def byte_view(storage: Any) -> Any:
    """A uint8 tensor over all of an UntypedStorage's bytes (shares its memory, keeps it alive)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


_libc_madvise: Any = None


def madvise(address: int, nbytes: int, advice: int) -> int:
    """madvise(2) on the `nbytes` at page-aligned `address`: 0, or the errno it failed with (advice: the
    caller decides what a refusal means)."""
    global _libc_madvise
    if _libc_madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_madvise = fn
    return 0 if _libc_madvise(address, nbytes, advice) == 0 else ctypes.get_errno()


# madvise(2) advice that faults a range's pages in, writable, without changing their contents (Linux 5.14+).
MADV_POPULATE_WRITE = 23
# Pages populated per call: small enough that the thread stops soon when asked, and that the reads it runs
# ahead of find each chunk's pages ready, large enough that the calls cost nothing beside the faults.
POPULATE_CHUNK_BYTES = 8 << 20


class Populator:
    """A thread that faults in the pages of `tensors` (fresh CPU memory about to be filled), in order.

    Why: on first touch every page of fresh memory costs a fault (and on a VM, often a trip to the host),
    paid by whoever writes it first. When that is the thread copying read bytes into place, the faults
    sit in the I/O pipeline; done here, on another core and ahead of it, they overlap the reads, and the
    copies find their pages present. MADV_POPULATE_WRITE leaves the bytes as they are, so running beside
    writes into the same memory is safe. Advice only: where the kernel lacks it, the thread just ends.
    Use as a context manager, or start() and close(); the tensors must outlive it (close() stops and joins
    the thread).
    """

    def __init__(self, tensors: Sequence[Any]) -> None:
        self._ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepnvme-populate", daemon=True)
        self.populated = 0  # bytes faulted in (pages wholly inside the tensors)
        self.finished = threading.Event()  # set when the thread has ended, whatever ended it

    def start(self) -> Populator:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> Populator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        try:
            self._populate()
        finally:
            self.finished.set()

    def _populate(self) -> None:
        for address, nbytes in self._ranges:
            at, end = round_up(address), (address + nbytes) // PAGE * PAGE
            while at < end:
                if self._stop.is_set():
                    return
                n = min(POPULATE_CHUNK_BYTES, end - at)
                refused = madvise(at, n, MADV_POPULATE_WRITE)
                if refused:
                    if refused in (errno.EINVAL, errno.ENOSYS):  # a kernel without the advice
                        return
                    break  # memory it cannot fault in (e.g. over a limit): leave this range to the writer
                self.populated += n
                at += n
