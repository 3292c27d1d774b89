"""deepnvme._core.memory.Populator: the thread load() uses to fault payload pages in ahead of its reads.

It must make fresh pages resident, never change a byte (it runs beside the copies that fill the same memory),
and stop when closed however much is left. Residency is read with mincore(2) on real anonymous memory.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from deepnvme._core.memory import PAGE, Populator, aligned_buffer

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(t: torch.Tensor) -> int:
    """How many pages of page-aligned tensor `t` are in memory (mincore)."""
    pages = t.numel() // PAGE
    vec = ctypes.create_string_buffer(pages)
    if _libc.mincore(t.data_ptr(), pages * PAGE, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec.raw)


def supported() -> bool:
    probe = aligned_buffer(PAGE)
    with Populator([probe]) as p:
        p.finished.wait()
    return p.populated == PAGE


needs_populate = pytest.mark.skipif(not supported(),
                                    reason="the kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")


@needs_populate
def test_fresh_pages_become_resident_with_their_bytes_unchanged() -> None:
    t = aligned_buffer(64 * PAGE + PAGE // 2)  # a partial last page: only whole pages inside are its to fault
    t[5 * PAGE:5 * PAGE + 3] = torch.tensor([7, 8, 9], dtype=torch.uint8)  # one page already written
    assert resident_pages(t[:64 * PAGE]) == 1
    with Populator([t[PAGE // 2:]]) as p:  # starts mid-page: the first partial page is not touched either
        assert p.finished.wait(60)
    assert p.populated == 63 * PAGE
    assert resident_pages(t[PAGE:64 * PAGE]) == 63
    expected = torch.zeros(t.numel(), dtype=torch.uint8)
    expected[5 * PAGE:5 * PAGE + 3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert torch.equal(t, expected)


@needs_populate
def test_writes_beside_it_are_kept() -> None:
    """A copy filling the memory while the populator walks it: every byte written stays written."""
    n = 2048 * PAGE
    t = aligned_buffer(n)
    src = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
    go = threading.Event()

    def writer() -> None:
        go.wait()
        for at in range(n - 256 * PAGE, -1, -256 * PAGE):  # from the far end, towards the populator
            t[at:at + 256 * PAGE].copy_(src[at:at + 256 * PAGE])

    w = threading.Thread(target=writer)
    w.start()
    with Populator([t]) as p:
        go.set()
        w.join()
        assert p.finished.wait(60)
    assert torch.equal(t, src)


def test_a_stop_is_heeded_before_each_chunk() -> None:
    """Stopped before its first chunk (as close() does mid-walk): it faults nothing more and ends."""
    t = aligned_buffer(64 * PAGE)
    p = Populator([t])
    p._stop.set()
    p.start()
    assert p.finished.wait(60)
    assert p.populated == 0 and resident_pages(t) == 0
    p.close()
    p.close()  # idempotent


def test_unstarted_close_and_empty_list() -> None:
    Populator([aligned_buffer(PAGE)]).close()  # never started: nothing to join
    with Populator([]) as p:
        assert p.finished.wait(60)
    assert p.populated == 0
