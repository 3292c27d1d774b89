"""deepnvme.save / deepnvme.load against the file system changing under them and failing early.

- load reads every byte from the file it opened, even when the path is atomically replaced meanwhile
  (a trainer saving `latest` while an evaluator loads it);
- save writes through a symbolic link to its target, as torch.save does, and keeps the link;
- save leaves no temporary file and no open descriptor when it fails before writing anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import deepnvme
from deepnvme._core import saving, zipformat
from deepnvme._core.direct import DIRECT_MIN_BYTES
from deepnvme._core.memory import PAGE
from deepnvme.serialization import TEMP_SUFFIX, archive_reader

# Several whole pages between a partial first and last page: head, tail and the O_DIRECT middle all read.
NUMEL = (DIRECT_MIN_BYTES + 5 * PAGE + 123) // 4


def _replace_path_once_records_are_read(monkeypatch: pytest.MonkeyPatch, path: Path, other: Path) -> None:
    """Atomically rename `other` over `path` right after load has opened `path` and read its directory,
    i.e. before any payload is read: the race of an evaluator loading while a trainer saves."""
    read_records = zipformat.read_records

    def records_then_replace(fd: int, name: str, **how: Any) -> Any:
        found = read_records(fd, name, **how)
        if other.exists():
            os.replace(other, path)
        return found

    monkeypatch.setattr(zipformat, "read_records", records_then_replace)


@pytest.mark.parametrize("proc", ["proc", "no-proc"])
@pytest.mark.parametrize("verify", [True, False])
def test_load_reads_the_file_it_opened_when_the_path_is_replaced(
        tmp_path: Path, handle: Any, monkeypatch: pytest.MonkeyPatch, verify: bool, proc: str) -> None:
    path, newer = tmp_path / "latest.pt", tmp_path / "newer.pt"
    old = {"w": torch.full((NUMEL,), 1.0)}
    deepnvme.save(old, path, handle=handle, checksum=verify)
    deepnvme.save({"w": torch.full((NUMEL,), 2.0)}, newer, handle=handle, checksum=verify)
    _replace_path_once_records_are_read(monkeypatch, path, newer)
    if proc == "no-proc":  # as where /proc is not mounted: the reopen by path must notice the other inode
        monkeypatch.setattr(archive_reader, "_PROC_FD", str(tmp_path / "no-proc" / "{}"))
    loaded = deepnvme.load(path, handle=handle, verify=verify)
    assert not newer.exists()  # the replacement did happen before the payload was read
    assert torch.equal(loaded["w"], old["w"])
    assert torch.equal(deepnvme.load(path, handle=handle)["w"], torch.full((NUMEL,), 2.0))



def test_payload_pages_are_read_o_direct_from_the_open_file(tmp_path: Path, handle: Any) -> None:
    """The same-file reopen must not cost the direct path where the file system allows O_DIRECT."""
    import fcntl

    from deepnvme.tools.pagecache import o_direct_works

    if not o_direct_works(str(tmp_path)):
        pytest.skip(f"{tmp_path}: the file system refuses O_DIRECT")
    path = tmp_path / "c.pt"
    deepnvme.save({"w": torch.ones(NUMEL)}, path, handle=handle)
    fd = os.open(path, os.O_RDONLY)
    try:
        records = zipformat.read_records(fd, str(path))
        assert records is not None
        with archive_reader.ArchiveReader(fd, str(path), records, handle, True) as reader:
            direct = reader._direct()
            assert direct != fd and fcntl.fcntl(direct, fcntl.F_GETFL) & os.O_DIRECT
            assert os.path.samestat(os.fstat(direct), os.fstat(fd))
    finally:
        os.close(fd)

def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class _Interrupted(KeyboardInterrupt):
    """A Ctrl-C arriving at a chosen point (its own class, so that no real one is mistaken for it)."""


def _fail(exc: BaseException) -> Any:
    def raising(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return raising


@pytest.mark.parametrize(("where", "exc"), [
    ("aligned_buffer", OSError(12, "Cannot allocate memory")),  # what mmap raises for ENOMEM
    ("aligned_buffer", _Interrupted()),
    ("AlignedWriter", _Interrupted()),
    ("AlignedWriter", MemoryError()),
])
def test_save_failing_before_the_first_write_leaves_no_temporary_and_no_fd(
        tmp_path: Path, handle: Any, monkeypatch: pytest.MonkeyPatch, where: str, exc: BaseException) -> None:
    path = tmp_path / "c.pt"
    before = {"w": torch.arange(10)}
    deepnvme.save(before, path, handle=handle)  # the handle's own descriptors exist from here on
    fds = _open_fds()
    monkeypatch.setattr(saving, where, _fail(exc))
    with pytest.raises(type(exc)):
        deepnvme.save({"w": torch.zeros(NUMEL)}, path, handle=handle)
    assert _open_fds() == fds
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]
    monkeypatch.undo()
    assert torch.equal(deepnvme.load(path, handle=handle)["w"], before["w"])


@pytest.mark.parametrize("link", ["absolute", "relative", "chain", "dangling"])
def test_save_writes_through_a_symbolic_link_as_torch_save(tmp_path: Path, handle: Any, link: str) -> None:
    store, names = tmp_path / "store", tmp_path / "names"
    store.mkdir()
    names.mkdir()
    target, path = store / "step-100.pt", names / "latest.pt"
    if link != "dangling":
        deepnvme.save({"w": torch.arange(5)}, target, handle=handle)
        os.chmod(target, 0o640)
    points_to = {"absolute": str(target), "relative": "../store/step-100.pt", "dangling": str(target),
                 "chain": str(names / "hop.pt")}[link]
    if link == "chain":
        os.symlink(target, names / "hop.pt")
    os.symlink(points_to, path)
    new = {"w": torch.full((NUMEL,), 3.0)}
    deepnvme.save(new, path, handle=handle)
    assert path.is_symlink() and os.readlink(path) == points_to  # the link is kept, pointing where it did
    assert torch.equal(torch.load(target, weights_only=True)["w"], new["w"])
    assert torch.equal(deepnvme.load(path, handle=handle)["w"], new["w"])
    if link != "dangling":
        assert os.stat(target).st_mode & 0o777 == 0o640
    assert not [p for d in (store, names) for p in d.iterdir() if p.name.endswith(TEMP_SUFFIX)]
