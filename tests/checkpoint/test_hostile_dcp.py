"""AioStorageReader against crafted and damaged DCP checkpoints, each compared with stock FileSystemReader on
the same directory: an item whose pickle claims more bytes than its record, storage paths that leave the
checkpoint directory, a `.metadata` that would run code, FIFOs where files should be; and real metadata
(every kind of value DCP writes) read by the restricted unpickler."""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zipcraft
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from deepnvme.checkpoint import AioStorageReader, AioStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WRITERS = [FileSystemWriter, AioStorageWriter]


def _state() -> dict[str, Any]:
    """Tensors of several dtypes and sizes (one past the inline limit), views, bytes and nested values."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(100_003, generator=g)
    return {
        "a": torch.arange(1000.0), "b": torch.arange(1000.0, 2000.0), "big": big, "view": big[5:505],
        "bf16": torch.randn(64, 3, generator=g).to(torch.bfloat16),
        "c64": torch.randn(9, dtype=torch.complex64),
        "i64": torch.arange(-5, 5), "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3), "t": torch.randn(7, 5, generator=g).t(),
        "f8": torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn), "blob": io.BytesIO(b"raw bytes"), "step": 7,
        "name": "run", "nested": {"l": [1, 2.5, "s"], "t": torch.ones(2, 2)},
    }


def _blank(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    if isinstance(sd, io.BytesIO):
        return io.BytesIO()
    return sd


def _load(directory: Path, reader: Callable[[Path], Any], sd: dict[str, Any]) -> dict[str, Any]:
    out = _blank(sd)
    dcp.load(out, storage_reader=reader(directory), no_dist=True)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        as_bytes = [t.reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]  # float8 has no equal()
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*as_bytes)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue()
    return a == b


def _metadata(directory: Path) -> Any:
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_metadata(directory: Path, md: Any) -> None:
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _info(md: Any, fqn: str) -> _StorageInfo:
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.__name__)
def test_real_metadata_of_every_kind_loads_through_the_restricted_unpickler(tmp_path: Path,
                                                                            writer: Any) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=writer(tmp_path / "c"), no_dist=True)
    assert _same(_load(tmp_path / "c", AioStorageReader, sd), sd)


@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.__name__)
@pytest.mark.parametrize("size", [3000, 1000, 0])
def test_an_item_whose_pickle_claims_more_than_its_record_is_refused(tmp_path: Path, writer: Any,
                                                                     size: int) -> None:
    """Stock raises "record size ... does not match"; reading on would give bytes of the neighbours."""
    directory = tmp_path / "c"
    sd = {"a": torch.arange(1000.0), "b": torch.arange(1000.0, 2000.0)}
    dcp.save(sd, storage_writer=writer(directory), no_dist=True)
    info = _info(_metadata(directory), "a")
    data = directory / info.relative_path
    blob = data.read_bytes()
    item = blob[info.offset:info.offset + info.length]
    edited = zipcraft.set_size(item, "data/0", size)
    data.write_bytes(blob[:info.offset] + edited + blob[info.offset + info.length:])
    with pytest.raises(CheckpointException, match="record size"):
        _load(directory, FileSystemReader, sd)
    with pytest.raises(CheckpointException, match=f"{data}: item 'a': the pickle asks for 4000 bytes"):
        _load(directory, AioStorageReader, sd)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_storage_paths_outside_the_checkpoint_directory_are_refused(tmp_path: Path, where: str) -> None:
    """Stock reads the file the metadata names wherever it is; ours refuses before opening anything."""
    directory = tmp_path / "c"
    sd = {"a": torch.arange(1000.0)}
    dcp.save(sd, storage_writer=AioStorageWriter(directory), no_dist=True)
    md = _metadata(directory)
    info = _info(md, "a")
    outside = tmp_path / "outside.distcp"
    (directory / info.relative_path).rename(outside)
    name = "../outside.distcp" if where == "parent" else str(outside)
    for index, old in list(md.storage_data.items()):
        md.storage_data[index] = _StorageInfo(name, old.offset, old.length)
    _write_metadata(directory, md)
    assert _same(_load(directory, FileSystemReader, sd), sd)  # stock: read from outside the checkpoint
    with pytest.raises(CheckpointException, match="not inside the checkpoint directory"):
        _load(directory, AioStorageReader, sd)


class _Runs:
    """Pickles as a call of os.mkdir: what a crafted `.metadata` could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return os.mkdir, (str(self.marker),)


def test_metadata_that_would_run_code_is_refused_before_it_runs(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    dcp.save({"a": torch.ones(3)}, storage_writer=AioStorageWriter(directory), no_dist=True)
    md = _metadata(directory)
    marker = tmp_path / "ran"
    md.planner_data = {"x": _Runs(marker)}
    _write_metadata(directory, md)
    FileSystemReader(directory).read_metadata()
    assert marker.is_dir()  # stock ran it
    marker.rmdir()
    with pytest.raises(ValueError, match="posix.mkdir is not one of DCP's metadata types") as caught:
        AioStorageReader(directory).read_metadata()
    assert caught.value.filename == str(directory / ".metadata")
    assert not marker.exists()


def test_a_subclass_may_allow_more_metadata_globals(tmp_path: Path) -> None:
    """What a user does for metadata written with an extra (trusted) class."""
    directory = tmp_path / "c"
    dcp.save({"a": torch.ones(3)}, storage_writer=AioStorageWriter(directory), no_dist=True)
    md = _metadata(directory)
    md.planner_data = {"x": io.BytesIO(b"1")}
    _write_metadata(directory, md)
    with pytest.raises(ValueError, match="_io.BytesIO"):
        AioStorageReader(directory).read_metadata()

    class Allowing(AioStorageReader):
        METADATA_GLOBALS = AioStorageReader.METADATA_GLOBALS | {("_io", "BytesIO")}

    assert Allowing(directory).read_metadata().planner_data["x"].getvalue() == b"1"


@pytest.mark.parametrize("which", [".metadata", "data"])
def test_a_fifo_in_the_checkpoint_is_refused_without_blocking(tmp_path: Path, which: str) -> None:
    directory = tmp_path / "c"
    sd = {"a": torch.arange(1000.0)}
    dcp.save(sd, storage_writer=AioStorageWriter(directory), no_dist=True)
    name = ".metadata" if which == ".metadata" else _info(_metadata(directory), "a").relative_path
    target = directory / name
    target.unlink()
    os.mkfifo(target)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            _load(directory, AioStorageReader, sd)
        except BaseException as exc:  # noqa: BLE001 - DCP wraps it (CheckpointException, AssertionError)
            outcome.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join(60)
    if loader.is_alive():
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
        loader.join()
        pytest.fail("AioStorageReader blocked on a FIFO")
    (error,) = outcome
    assert "not a regular file" in str(error) and str(target) in str(error)
