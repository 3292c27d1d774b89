"""Memory the O_DIRECT paths need: the page size, page-aligned buffers, and raw views of tensor memory.

O_DIRECT transfers need their memory, file offset and length aligned; the page is the unit every common
device accepts, so it is the one alignment the library uses.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

from deepnvme._core.checks import check_int

__all__ = ["PAGE", "address_of", "aligned_buffer", "byte_view", "memory_of", "round_up"]

PAGE = mmap.PAGESIZE


def round_up(n: int, unit: int = PAGE) -> int:
    """The smallest multiple of ``unit`` that is >= ``n``."""
    return -(-n // unit) * unit


def aligned_buffer(nbytes: int) -> Any:
    """A page-aligned uint8 tensor of `nbytes` in anonymous memory: usable for O_DIRECT, not locked.

    Locked memory is capped by RLIMIT_MEMLOCK (often 8 MiB), so staging buffers are plain pages. Private
    ones: mmap's default for anonymous memory is shared (shmem), whose pages cost about half as much again
    to fault in, and which a forked child would keep writing into the parent's buffer through.
    """
    import torch

    check_int("nbytes", nbytes)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
