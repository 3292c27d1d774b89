"""The swap file's ranges: a unit removed gives its range back (the file cut at its end, or the blocks of a
range inside released and the range reused), and a full drive is an error when a unit is added."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from deepnvme.offload.swap import SwapSpace
from tests.offload.helpers import tmpfs

PAGE = 4096


def test_removed_units_give_their_space_back(workdir: Path) -> None:
    with SwapSpace(workdir, 64 * PAGE) as space:
        a, b, c = (space.add(n, 8 * PAGE) for n in "abc")
        for u in (a, b, c):
            lease = space.allocate([u])
            lease.view(u).fill_(7)
            lease.write_back()
        space.wait_writes()
        blocks = os.stat(space.file).st_blocks
        space.remove(b)  # inside: its blocks are released, the length kept
        assert os.stat(space.file).st_size == 24 * PAGE
        assert os.stat(space.file).st_blocks <= blocks - 8 * PAGE // 512
        assert space.reserved_bytes == 16 * PAGE
        d = space.add("d", 5 * PAGE)  # the smallest free range that fits
        assert d.offset == b.offset and space.reserved_bytes == 21 * PAGE
        space.remove(c)  # at the end: the file is cut, and the free range before it goes with it
        assert os.stat(space.file).st_size == 16 * PAGE - 3 * PAGE
        space.check_files()
        with pytest.raises(ValueError, match="'c' is not an owned unit of this swap space"):
            space.remove(c)
        lease = space.read([a])
        lease.wait()
        assert bool((lease.view(a) == 7).all())
        lease.release()


def test_a_full_drive_is_refused_when_a_unit_is_added(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=256k") as small, SwapSpace(small, 16 * PAGE) as space:
        space.add("a", 16 * PAGE)
        with pytest.raises(OSError) as caught:
            for i in range(100):
                space.add(f"u{i}", 16 * PAGE)
        assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(small)
        assert "no space for 65536 more bytes of swap" in str(caught.value)
