"""O_DIRECT really in effect: after a transfer through aio_handle on the real disk, none of the file's pages
is in the page cache (mincore over a mapping of the file). A transfer that silently went through a buffered
descriptor moves the right bytes, so only the page cache tells it apart. Every engine, locked and staged
(plain, misaligned) tensors, inline (one block) and worker (many blocks) requests, writes and reads."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from deepnvme.tools.pagecache import drop_file_cache, read_mode

PAGE = mmap.PAGESIZE
BLOCK = 1 << 20
U8 = torch.empty(0, dtype=torch.uint8)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mapping a file faults nothing in)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed", str(path))
        try:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
            return sum(b & 1 for b in vec.raw)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.fixture
def direct_dir(workdir: Path) -> Path:
    """The work directory, where O_DIRECT must work (it does on the disk the suite runs on)."""
    if read_mode(str(workdir)) != "O_DIRECT":
        pytest.skip(f"O_DIRECT does not work in {workdir}")
    return workdir


@pytest.mark.parametrize("nbytes", [BLOCK // 2, 8 * BLOCK], ids=["inline", "workers"])
@pytest.mark.parametrize("memory", ["locked", "staged"])
def test_direct_transfers_leave_no_cached_pages(aio_module: ModuleType, engine: str, direct_dir: Path,
                                                memory: str, nbytes: int) -> None:
    h = aio_module.aio_handle(BLOCK, 8, False, True, 2, engine=engine)
    if memory == "locked":
        t = h.new_cpu_locked_tensor(nbytes, U8)
    else:
        t = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]  # misaligned for any O_DIRECT: staged
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    want = t.clone()
    path = direct_dir / f"f-{engine}-{memory}"
    assert h.sync_pwrite(t, str(path)) == 1
    assert cached_pages(path) == 0, f"{engine} {memory}: the write left pages in the page cache"
    assert path.read_bytes() == want.numpy().tobytes()
    assert cached_pages(path) > 0  # a buffered read caches pages, and cached_pages() sees them
    assert drop_file_cache(str(path)) and cached_pages(path) == 0
    t.zero_()
    assert h.sync_pread(t, str(path)) == 1
    assert cached_pages(path) == 0, f"{engine} {memory}: the read left pages in the page cache"
    assert torch.equal(t, want)
    if memory == "locked":
        h.free_cpu_locked_tensor(t)
