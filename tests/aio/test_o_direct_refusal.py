"""One O_DIRECT refusal rule for aio_handle, deepnvme.save/load and SwapSpace, on real file systems: ramfs,
which Linux itself makes refuse O_DIRECT with EINVAL, and a FUSE file system (tests/support/fusefs.py) that
refuses it with EOPNOTSUPP in its own open, as some FUSE and network file systems do. Each caller opens
the file buffered instead, gives the same bytes, and warns once per file system; any other error from the
O_DIRECT open is the file's and is raised. The rule is written once per language (csrc/aio/file.h,
deepnvme/_core/direct.py): the last test holds the two to the same errno set."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from fusefs import refusing_o_direct
from mounts import mounted

import deepnvme
from deepnvme._core.direct import O_DIRECT_REFUSED
from deepnvme.offload import SwapSpace

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def refusing(kind: str, where: Path) -> Iterator[tuple[Path, int, object]]:
    """A fresh mount of `kind` that refuses O_DIRECT: (its path, the errno it refuses with, its handle)."""
    if kind == "ramfs":
        with mounted(where, "ramfs") as mnt:
            yield mnt, errno.EINVAL, None
    else:
        with refusing_o_direct(where, errno.EOPNOTSUPP) as fs:
            yield fs.path, errno.EOPNOTSUPP, fs


def odirect_warnings(caught: list[warnings.WarningMessage], mnt: Path) -> list[str]:
    found = [str(w.message) for w in caught if "O_DIRECT is not supported" in str(w.message)]
    assert all(issubclass(w.category, RuntimeWarning) for w in caught if "O_DIRECT" in str(w.message))
    assert all(f"mounted at {mnt}" in m for m in found), found
    return found


@pytest.mark.parametrize("kind", ["ramfs", "fuse"])
def test_each_caller_goes_buffered_with_one_notice(aio_module: ModuleType, tmp_path: Path, kind: str) -> None:
    with refusing(kind, tmp_path / kind) as (mnt, refused_errno, fs):
        # The file system really answers O_DIRECT with that errno (and plain opens work).
        with pytest.raises(OSError) as caught_open:
            os.open(mnt / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        assert caught_open.value.errno == refused_errno
        data = os.urandom(3 * 4096 + 5)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        obj = {"w": torch.randn(70_000), "s": torch.arange(7)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # aio_handle by path, sync and async, several handles: one notice from the C++ side.
            for _ in range(2):
                h = aio_module.aio_handle(4096, 8, False, False, 2)
                assert h.sync_pwrite(src, str(mnt / "h.bin"), 0) == 1
                back = torch.zeros_like(src)
                assert h.async_pread(back, str(mnt / "h.bin"), 0) == 0 and h.wait() == 1
                assert bytes(back.numpy()) == data
            handle_notes = odirect_warnings(caught, mnt)
            assert len(handle_notes) == 1 and "h.bin" in handle_notes[0]
            # save/load (the Python side): its own notice, naming the checkpoint, not its temporary.
            for _ in range(2):
                deepnvme.save(obj, mnt / "c.pt")
                back_obj = deepnvme.load(mnt / "c.pt")
                assert all(torch.equal(obj[k], back_obj[k]) for k in obj)
            python_notes = odirect_warnings(caught, mnt)[1:]
            assert len(python_notes) == 1 and f"first seen with {mnt / 'c.pt'})" in python_notes[0]
            # SwapSpace: buffered, correct, and no further notice for this file system.
            with SwapSpace(mnt, 1 << 20) as space:
                assert not space.direct
                unit = space.add("u", 10_000)
                lease = space.allocate([unit])
                lease.view(unit).copy_(torch.arange(10_000, dtype=torch.int64).to(torch.uint8))
                lease.write_back()
                space.wait_writes()
                read = space.read([unit])
                read.wait()
                assert torch.equal(read.view(unit), torch.arange(10_000, dtype=torch.int64).to(torch.uint8))
                read.release()
            assert len(odirect_warnings(caught, mnt)) == 2
    if fs is not None:
        assert fs.refused >= 4  # the handle's, save's, load's and the swap file's O_DIRECT opens reached it


def test_a_new_file_system_gets_its_own_notice(tmp_path: Path) -> None:
    """Once per file system, not once per process: a second mount (even one reusing the first's device
    number) warns again."""
    for i in range(2):
        with refusing("ramfs", tmp_path / f"r{i}") as (mnt, _, _):
            with pytest.warns(RuntimeWarning, match=f"mounted at {re.escape(str(mnt))} "):
                deepnvme.save({"x": torch.ones(3)}, mnt / "c.pt")


def test_any_other_error_of_the_o_direct_open_is_raised(aio_module: ModuleType, tmp_path: Path) -> None:
    """EIO from the file system's open is about the file, not the mode: raised by every caller, nothing
    written, no fallback."""
    with refusing_o_direct(tmp_path / "eio", errno.EIO) as fs, warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        h = aio_module.aio_handle(4096, 8, False, False, 1)
        with pytest.raises(OSError) as caught:
            h.sync_pwrite(torch.ones(4096, dtype=torch.uint8), str(fs.path / "h.bin"), 0)
        assert caught.value.errno == errno.EIO and caught.value.filename == str(fs.path / "h.bin")
        with pytest.raises(OSError) as caught:
            deepnvme.save({"x": torch.ones(3)}, fs.path / "c.pt")
        assert caught.value.errno == errno.EIO
        with pytest.raises(OSError) as caught:
            SwapSpace(fs.path, 1 << 20)
        assert caught.value.errno == errno.EIO
        assert [n for n in os.listdir(fs.path) if n.endswith((".pt", ".deepnvme-tmp"))] == []


def test_python_and_cpp_share_one_errno_set() -> None:
    """csrc/aio/file.h's kODirectRefused and _core.direct.O_DIRECT_REFUSED name the same errors."""
    header = (REPO / "csrc/aio/file.h").read_text()
    listed = re.search(r"kODirectRefused\[\]\s*=\s*\{([^}]*)\}", header)
    assert listed, "csrc/aio/file.h lost kODirectRefused"
    names = [n.strip() for n in listed.group(1).split(",") if n.strip()]
    assert {getattr(errno, n) for n in names} == O_DIRECT_REFUSED == {errno.EINVAL, errno.EOPNOTSUPP}
