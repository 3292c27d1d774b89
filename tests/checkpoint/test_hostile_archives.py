"""deepnvme.load against crafted and damaged torch archives, each compared with stock torch.load on the same
file: the same tensors as stock, or a CheckpointFormatError / OSError naming the file; never tensors that
differ from what the file says, storage the file does not share, a torch error of another type, a wait on a
FIFO, or a save error that names a temporary file."""

from __future__ import annotations

import errno
import fractions
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zipcraft

import deepnvme
from deepnvme._core import zipformat
from deepnvme.serialization import prefetch
from op_builder.atomic_file import TEMP_SUFFIX

BIG = 300_000  # float32 elements: a payload the prefetch reads O_DIRECT into a storage of its own


def _stock(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _archive(tmp_path: Path, saver: str, obj: Any, checksum: bool = True) -> bytes:
    path = tmp_path / f"base-{saver}.pt"
    if saver == "torch":
        torch.save(obj, path)
    else:
        deepnvme.save(obj, path, checksum=checksum)
    return path.read_bytes()


def _refused(path: Path, load: Callable[[], Any] | None = None) -> deepnvme.CheckpointFormatError:
    with pytest.raises(deepnvme.CheckpointFormatError) as caught:
        (load or (lambda: deepnvme.load(path)))()
    assert caught.value.filename == str(path)
    return caught.value


SAVERS = ["torch", "deepnvme"]


@pytest.mark.parametrize("saver", SAVERS)
def test_two_entries_over_the_same_bytes_never_load_as_one_storage(tmp_path: Path, saver: str) -> None:
    """Stock loads two independent copies; sharing one storage would make a write to one change the other."""
    obj = {"a": torch.arange(100.0), "b": torch.arange(100.0, 200.0)}
    path = _write(tmp_path / "alias.pt", zipcraft.alias(_archive(tmp_path, saver, obj), "data/1", "data/0"))
    stock = _stock(path)
    assert stock["a"].untyped_storage().data_ptr() != stock["b"].untyped_storage().data_ptr()
    assert "overlaps" in str(_refused(path))


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("where", ["before the start", "past the end"])
def test_an_end_record_with_a_wrong_directory_offset_names_the_file(tmp_path: Path, saver: str,
                                                                    where: str) -> None:
    data = _archive(tmp_path, saver, {"a": torch.arange(100.0)})
    offset = 10 if where == "past the end" else len(data) + 1000  # the central directory shifts the other way
    path = _write(tmp_path / "dir.pt", zipcraft.set_directory_offset(data, offset))
    with pytest.raises(RuntimeError):
        _stock(path)
    _refused(path)


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("member", ["data.pkl", "data/0"])
def test_members_named_with_dot_dot_are_format_errors(tmp_path: Path, saver: str, member: str) -> None:
    """torch refuses them with RuntimeError; within deepnvme.load that is a CheckpointFormatError."""
    data = _archive(tmp_path, saver, {"a": torch.arange(100.0)})
    name = zipcraft.entry(data, member).name
    path = _write(tmp_path / "dots.pt", zipcraft.rename(data, member, "../" + name[3:]))
    with pytest.raises(RuntimeError):
        _stock(path)
    error = _refused(path)
    assert isinstance(error.__cause__, RuntimeError)


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("size", [200, 800, 0])
def test_a_record_of_another_size_than_the_pickle_says_is_refused(tmp_path: Path, saver: str,
                                                                  size: int) -> None:
    """Without CRCs to catch it (checksum=False, or torch's own files after a CRC-preserving edit), a record
    whose directory size disagrees with the pickle: stock raises "record size ... does not match"."""
    data = _archive(tmp_path, saver, {"a": torch.arange(100.0), "b": torch.arange(7.0)}, checksum=False)
    path = _write(tmp_path / "size.pt", zipcraft.set_size(data, "data/0", size))
    with pytest.raises(RuntimeError):
        _stock(path)
    _refused(path)
    _refused(path, lambda: deepnvme.load(path, map_location="cpu", verify=False))


@pytest.mark.parametrize("cut", [100, 500_000, 1_190_000])
@pytest.mark.parametrize("stage", ["after the directory", "during the reads"])
def test_a_file_cut_short_while_loading_is_a_format_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: int, stage: str) -> None:
    path = tmp_path / "shrinks.pt"
    deepnvme.save({"w": torch.randn(BIG), "s": torch.arange(10)}, path)
    if stage == "after the directory":
        read_records = zipformat.read_records

        def records_then_cut(fd: int, name: str, **how: Any) -> Any:
            found = read_records(fd, name, **how)
            os.truncate(path, cut)
            return found

        monkeypatch.setattr(zipformat, "read_records", records_then_cut)
    else:
        read = prefetch.Prefetched._read

        def cut_then_read(self: Any, fd: int, *args: Any) -> None:
            os.truncate(path, cut)
            read(self, fd, *args)

        monkeypatch.setattr(prefetch.Prefetched, "_read", cut_then_read)
    assert "truncated" in str(_refused(path))


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    def load() -> None:
        outcome.append(pytest.raises(OSError, deepnvme.load, fifo).value)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join(60)
    if loader.is_alive():  # blocked in open(): give it a writer so that the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        loader.join()
        pytest.fail("deepnvme.load blocked on a FIFO")
    (error,) = outcome
    assert isinstance(error, OSError) and error.errno == errno.EINVAL and error.filename == str(fifo)


def test_a_weights_only_refusal_is_stocks_unpickling_error_and_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    torch.save({"x": fractions.Fraction(1, 3)}, path)  # a type torch's weights-only unpickler refuses
    with pytest.raises(pickle.UnpicklingError):
        _stock(path)
    error = _refused(path)
    assert isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error)


def test_a_format_error_pickles_whole(tmp_path: Path) -> None:
    """torch.distributed.checkpoint gathers a rank's error to every rank by pickling it: it comes back
    the same class, naming the same file (the default pickling called the class with the message alone)."""
    path = tmp_path / "a.pt"
    path.write_bytes(b"not a checkpoint")
    error = _refused(path)
    error.add_note("a note")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and back.filename == str(path)
    assert back.__notes__ == ["a note"]


def test_an_unservable_map_location_is_not_called_a_format_error(tmp_path: Path) -> None:
    """The file is fine; the caller's map_location is what fails: torch's own error, unchanged."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    path = tmp_path / "a.pt"
    deepnvme.save({"w": torch.randn(BIG)}, path)
    with pytest.raises(RuntimeError) as caught:
        deepnvme.load(path, map_location="cuda")
    assert not isinstance(caught.value, deepnvme.CheckpointFormatError)


def test_a_save_on_a_read_only_file_system_reports_the_path_and_keeps_the_file(
        read_only_mount: tuple[Path, Callable[[], None]]) -> None:
    point, make_read_only = read_only_mount
    path = point / "a.pt"
    deepnvme.save({"w": torch.arange(10.0)}, path)
    make_read_only()
    with pytest.raises(OSError) as caught:
        deepnvme.save({"w": torch.zeros(10)}, path)
    assert caught.value.errno == errno.EROFS and caught.value.filename == str(path)
    assert TEMP_SUFFIX not in str(caught.value)
    assert torch.equal(deepnvme.load(path)["w"], torch.arange(10.0))
