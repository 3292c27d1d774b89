"""deepnvme.save / deepnvme.load: torch's format both ways, every dtype, views, and each kind of bad input."""

from __future__ import annotations

import errno
import io
import os
import pickle
import struct
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import deepnvme
from deepnvme._core.archive_writer import SaveStream, page_aligned_storages, storages_of
from deepnvme._core.direct import DIRECT_MIN_BYTES, AlignedWriter, close_pair, open_for_write
from deepnvme._core.memory import PAGE, aligned_buffer, byte_view
from deepnvme._core.zipformat import read_records as _records
from deepnvme.serialization import CheckpointFormatError
from deepnvme.serialization.archive_reader import ArchiveReader

BIG = DIRECT_MIN_BYTES + 12_345  # a payload large enough for the direct path, with a partial last page


def _dtypes() -> list[torch.dtype]:
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
             "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
             "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
    return [getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


def _random_of(dtype: torch.dtype, nbytes: int, seed: int) -> torch.Tensor:
    """A tensor of `dtype` whose bytes are random (bool: 0/1), about `nbytes` long."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (nbytes,), generator=g, dtype=torch.uint8).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes // size * size,), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def _same(a: Any, b: Any) -> bool:
    """Equal structure, and tensors equal in dtype, shape, strides, offset and bytes (NaN patterns too)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
                and torch.equal(byte_view(a.untyped_storage()), byte_view(b.untyped_storage())))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_dtype_round_trips_both_ways(tmp_path: Path, handle: Any) -> None:
    """Small and direct-path payloads of every dtype: deepnvme.save -> torch.load/deepnvme.load, and
    torch.save -> deepnvme.load, all give back the same bytes."""
    obj = {}
    for i, dtype in enumerate(_dtypes()):
        obj[f"{dtype}_small"] = _random_of(dtype, 1000 + i, seed=i)
        obj[f"{dtype}_big"] = _random_of(dtype, BIG + 16 * i, seed=100 + i)
    ours, stock = tmp_path / "ours.pt", tmp_path / "stock.pt"
    deepnvme.save(obj, ours, handle=handle)
    torch.save(obj, stock)
    assert _same(obj, torch.load(ours, weights_only=True))
    assert _same(obj, deepnvme.load(ours, handle=handle))
    assert _same(obj, deepnvme.load(stock, handle=handle))


def test_payloads_are_page_aligned_and_go_direct_from_tensor_memory(tmp_path: Path, handle: Any) -> None:
    """The archive puts every payload on a page, and the large payloads reach the handle from the
    tensors' own memory: only the small records and partial pages are staged."""
    obj = {f"w{i}": torch.randn(BIG // 4 + i) for i in range(4)} | {"tiny": torch.arange(3)}
    path = str(tmp_path / "a.pt")
    direct, buffered = open_for_write(path, os.O_CREAT)
    writer = AlignedWriter(handle, direct, buffered, [aligned_buffer(1 << 20) for _ in range(2)])
    try:
        stream = SaveStream(writer, storages_of(obj, pickle, 2))
        with page_aligned_storages():
            torch.save(obj, stream)
        writer.finish()
    finally:
        close_pair(direct, buffered)
    payload = sum(t.numel() * t.element_size() for k, t in obj.items() if k != "tiny")
    assert writer.bytes_direct >= payload - 4 * PAGE
    assert writer.bytes_staged < 64 << 10
    assert _same(obj, torch.load(path, weights_only=True))
    with open(path, "rb") as f:
        members = zipfile.ZipFile(f).infolist()
        fd = f.fileno()
        offsets = [o for o, r in _records(fd, path).items() if "/data/" in r.name]
    assert len(offsets) == 5 and all(o % 4096 == 0 for o in offsets), (offsets, members)


def test_load_reads_payloads_through_the_handle_into_torchs_memory(tmp_path: Path, handle: Any) -> None:
    """A failing handle makes load fail: the payload bytes come through it, not through torch's reads."""
    obj = {"w": torch.randn(BIG)}
    path = tmp_path / "a.pt"
    deepnvme.save(obj, path, handle=handle)
    fd = os.open(path, os.O_RDONLY)
    try:
        records = _records(fd, str(path))
        with ArchiveReader(fd, str(path), records, handle, verify=True) as reader:
            got = torch.load(reader, weights_only=True)
    finally:
        os.close(fd)
    assert reader.error is None and _same(obj, got)


def test_shared_storage_is_saved_once_and_views_come_back_as_views(tmp_path: Path, handle: Any) -> None:
    base = torch.randn(300_000)
    grid = base.view(300, 1000)
    obj = {"base": base, "slice": base[10:2000], "strided": grid[:, ::7], "t": grid.t(), "row": grid[5]}
    path = tmp_path / "v.pt"
    deepnvme.save(obj, path, handle=handle)
    with zipfile.ZipFile(path) as z:
        assert sum("/data/" in n for n in z.namelist()) == 1
    got = deepnvme.load(path, handle=handle)
    assert _same(obj, got)
    ptr = got["base"].untyped_storage().data_ptr()
    assert all(got[k].untyped_storage().data_ptr() == ptr for k in obj)
    got["base"][10] = 1234.0
    assert got["slice"][0] == 1234.0  # a view, not a copy


def test_module_state_and_plain_python_objects(tmp_path: Path, handle: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 600), torch.nn.LayerNorm(600), torch.nn.Linear(600, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    obj = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "name": "run-1",
           "ratios": [0.5, 1.5], "empty": torch.empty(0), "scalar": torch.tensor(3.5),
           "param": torch.nn.Parameter(torch.randn(10))}
    path = tmp_path / "m.pt"
    deepnvme.save(obj, path, handle=handle)
    got = deepnvme.load(path, handle=handle)
    assert _same(obj["model"], got["model"]) and got["step"] == 7 and got["ratios"] == [0.5, 1.5]
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    assert got["optim"]["param_groups"] == opt.state_dict()["param_groups"]


def test_legacy_format_and_crc_less_archives_load(tmp_path: Path, handle: Any) -> None:
    obj = {"w": torch.randn(BIG // 4), "n": 3}
    legacy, nocrc = tmp_path / "legacy.pt", tmp_path / "nocrc.pt"
    torch.save(obj, legacy, _use_new_zipfile_serialization=False)
    deepnvme.save(obj, nocrc, handle=handle, checksum=False)
    with zipfile.ZipFile(nocrc) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    assert _same(obj, deepnvme.load(legacy, handle=handle))
    assert _same(obj, deepnvme.load(nocrc, handle=handle))
    assert _same(obj, torch.load(nocrc, weights_only=True))


def test_concurrent_saves_with_different_checksum_choices(tmp_path: Path) -> None:
    """torch's save settings are process-wide: saves in threads each get theirs, and they are restored."""
    import threading

    from torch.utils.serialization import config

    before = (config.save.storage_alignment, config.save.compute_crc32)
    objs = [{"w": torch.randn(BIG // 4 + i)} for i in range(6)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                deepnvme.save(objs[i], tmp_path / f"{i}.pt", checksum=bool(i % 2))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, obj in enumerate(objs):
        with zipfile.ZipFile(tmp_path / f"{i}.pt") as z:
            assert all((m.CRC != 0) == bool(i % 2) for m in z.infolist() if m.file_size)
        assert _same(obj, deepnvme.load(tmp_path / f"{i}.pt"))
    assert (config.save.storage_alignment, config.save.compute_crc32) == before


@pytest.mark.parametrize("where", ["cpu", "callable", "dict", "device", "meta"])
def test_map_location_as_torch_load(tmp_path: Path, handle: Any, where: str) -> None:
    obj = {"w": torch.randn(BIG // 4), "b": torch.arange(5)}
    path = tmp_path / "a.pt"
    deepnvme.save(obj, path, handle=handle)
    seen: list[str] = []

    def to_cpu(storage: Any, location: str) -> Any:
        seen.append(location)
        return storage

    location = {"cpu": "cpu", "callable": to_cpu, "dict": {"cpu": "cpu"}, "device": torch.device("cpu"),
                "meta": "meta"}[where]
    got = deepnvme.load(path, map_location=location, handle=handle)
    want = torch.load(path, map_location=location, weights_only=True)
    assert {k: (t.device, t.dtype, t.shape) for k, t in got.items()} == \
           {k: (t.device, t.dtype, t.shape) for k, t in want.items()}
    if where != "meta":
        assert _same(obj, got)
    if where == "callable":
        assert seen == ["cpu", "cpu", "cpu", "cpu"]  # once per storage, in both loads


class Opaque:
    """A user class: not allowed by weights_only=True, as in torch.load."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_weights_only_as_torch_load(tmp_path: Path, handle: Any) -> None:
    path = tmp_path / "o.pt"
    deepnvme.save({"o": Opaque(5), "t": torch.ones(2)}, path, handle=handle)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed") as caught:
        deepnvme.load(path, handle=handle)
    assert str(path) in "".join(getattr(caught.value, "__notes__", [])) or str(path) in str(caught.value)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
    assert deepnvme.load(path, weights_only=False, handle=handle)["o"].value == 5


def test_replacing_a_longer_checkpoint_leaves_no_tail_and_keeps_the_mode(tmp_path: Path, handle: Any) -> None:
    path = tmp_path / "c.pt"
    deepnvme.save({"w": torch.randn(1 << 20)}, path, handle=handle)
    os.chmod(path, 0o640)
    small = {"w": torch.randn(10)}
    deepnvme.save(small, path, handle=handle)
    buf = io.BytesIO()
    torch.save(small, buf)
    assert os.path.getsize(path) < 64 << 10 and _same(small, torch.load(path, weights_only=True))
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_save_to_missing_directory_or_a_directory(tmp_path: Path, handle: Any) -> None:
    missing = tmp_path / "no" / "such" / "c.pt"
    with pytest.raises(FileNotFoundError) as caught:
        deepnvme.save({"w": torch.ones(3)}, missing, handle=handle)
    assert caught.value.filename == str(missing) and caught.value.errno == errno.ENOENT
    with pytest.raises(IsADirectoryError) as caught:
        deepnvme.save({"w": torch.ones(3)}, tmp_path, handle=handle)
    assert caught.value.filename == str(tmp_path)
    with pytest.raises(TypeError, match="path"):
        deepnvme.save({"w": torch.ones(3)}, 3, handle=handle)  # type: ignore[arg-type]


def test_unpicklable_object_graph_fails_before_any_file_exists(tmp_path: Path, handle: Any) -> None:
    path = tmp_path / "c.pt"
    deepnvme.save({"w": torch.ones(3)}, path, handle=handle)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        deepnvme.save({"w": torch.ones(3), "f": lambda x: x}, path, handle=handle)
    assert _same({"w": torch.ones(3)}, deepnvme.load(path, handle=handle))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_load_missing_file_and_directory(tmp_path: Path, handle: Any) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        deepnvme.load(tmp_path / "none.pt", handle=handle)
    assert caught.value.filename == str(tmp_path / "none.pt")
    with pytest.raises(IsADirectoryError) as caught:
        deepnvme.load(tmp_path, handle=handle)
    assert caught.value.filename == str(tmp_path)


def _saved(tmp_path: Path, handle: Any) -> tuple[Path, bytes, dict]:
    obj = {"w": torch.randn(BIG // 4), "small": torch.arange(100), "meta": {"step": 3}}
    path = tmp_path / "good.pt"
    deepnvme.save(obj, path, handle=handle)
    return path, path.read_bytes(), obj


@pytest.mark.parametrize("fraction", [0.0001, 0.3, 0.7, 0.99, 0.9999])
def test_truncated_file_names_the_file(tmp_path: Path, handle: Any, fraction: float) -> None:
    _, data, _ = _saved(tmp_path, handle)
    bad = tmp_path / "cut.pt"
    bad.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointFormatError) as caught:
        deepnvme.load(bad, handle=handle)
    assert caught.value.filename == str(bad) and str(bad) in str(caught.value)


def _member_span(data: bytes, suffix: str) -> tuple[int, int]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.file_size


@pytest.mark.parametrize("where", ["big payload head", "big payload middle", "big payload tail",
                                   "small payload", "pickle", "central directory", "local header"])
def test_corrupted_byte_is_an_error_naming_the_file(tmp_path: Path, handle: Any, where: str) -> None:
    _, data, _ = _saved(tmp_path, handle)
    big, small = _member_span(data, "/data/0"), _member_span(data, "/data/1")
    pkl = _member_span(data, "data.pkl")
    at = {"big payload head": big[0] + 3, "big payload middle": (big[0] + big[1]) // 2,
          "big payload tail": big[1] - 2, "small payload": small[0] + 5, "pickle": pkl[0] + 20,
          "central directory": data.rindex(b"PK\x01\x02") + 20, "local header": big[0] - 4096 + 2}[where]
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:])
    with pytest.raises(CheckpointFormatError) as caught:
        deepnvme.load(bad, handle=handle)
    assert caught.value.filename == str(bad)


@pytest.mark.parametrize("kind", ["empty", "text", "random", "zip without data.pkl", "numpy npy", "pickle"])
def test_file_of_another_format(tmp_path: Path, handle: Any, kind: str) -> None:
    bad = tmp_path / f"other.{kind.replace(' ', '_')}"
    if kind == "zip without data.pkl":
        with zipfile.ZipFile(bad, "w") as z:
            z.writestr("readme.txt", "hello")
    else:
        bad.write_bytes({"empty": b"", "text": b"just some text\n" * 100,
                         "random": os.urandom(10_000),
                         "numpy npy": b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'}" + b"\0" * 64,
                         "pickle": pickle.dumps({"a": 1}, protocol=4)}[kind])
    with pytest.raises(CheckpointFormatError) as caught:
        deepnvme.load(bad, handle=handle)
    assert caught.value.filename == str(bad)


def test_handle_failures_raise_oserror_naming_the_path(tmp_path: Path, aio_module: ModuleType,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected EIO (the test-only fault engine) on save and on load: OSError naming the checkpoint, the
    previous file intact, no temporary left."""
    good = {"w": torch.randn(BIG)}
    path = tmp_path / "c.pt"
    deepnvme.save(good, path)
    monkeypatch.setenv("DEEPNVME_FAULT", "eio@2")
    failing = aio_module.aio_handle(block_size=1 << 16, queue_depth=8, intra_op_parallelism=1, engine="fault")
    with pytest.raises(OSError) as caught:
        deepnvme.save({"w": torch.randn(BIG)}, path, handle=failing)
    assert caught.value.errno == errno.EIO and caught.value.filename == str(path)
    assert _same(good, deepnvme.load(path)) and [p.name for p in tmp_path.iterdir()] == ["c.pt"]
    failing = aio_module.aio_handle(block_size=1 << 16, queue_depth=8, intra_op_parallelism=1, engine="fault")
    with pytest.raises(OSError) as caught:
        deepnvme.load(path, handle=failing)
    assert caught.value.errno == errno.EIO and caught.value.filename == str(path)


def test_default_handle_is_per_thread_and_lazy_exports() -> None:
    import threading

    from deepnvme._core.handles import default_handle

    mine = default_handle()
    assert default_handle() is mine
    other: list[Any] = []
    t = threading.Thread(target=lambda: other.append(default_handle()))
    t.start()
    t.join()
    assert other[0] is not mine
    assert deepnvme.save is deepnvme.serialization.save and "load" in dir(deepnvme)


def test_memory_file_system_without_o_direct_still_works(handle: Any) -> None:
    """/dev/shm (tmpfs): O_DIRECT may be refused there; save and load fall back to buffered I/O."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm on this machine")
    path = shm / f"deepnvme-test-{os.getpid()}.pt"
    obj = {"w": torch.randn(BIG // 4 + 3)}
    try:
        deepnvme.save(obj, path, handle=handle)
        assert _same(obj, deepnvme.load(path, handle=handle))
    finally:
        path.unlink(missing_ok=True)


def test_mmap_is_torch_loads_memory_mapped_path(tmp_path: Path, handle: Any) -> None:
    obj = {"w": torch.randn(BIG // 4)}
    path = tmp_path / "a.pt"
    deepnvme.save(obj, path, handle=handle)
    assert _same(obj, deepnvme.load(path, mmap=True, handle=handle))


def test_file_system_refusing_o_direct_falls_back_to_buffered_io(tmp_path: Path, handle: Any) -> None:
    """ramfs refuses O_DIRECT (EINVAL), as tmpfs did before Linux 6.6: save, load and FastFileWriter
    then write and read through the page cache, with the same results."""
    import subprocess

    from deepnvme.io import FastFileWriter, FastFileWriterConfig
    from deepnvme.tools.pagecache import o_direct_works

    mnt = tmp_path / "ram"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting ramfs needs root")
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount ramfs here: {done.stderr.strip()}")
    try:
        assert not o_direct_works(str(mnt))
        obj = {"w": torch.randn(BIG // 4 + 5), "s": torch.arange(7)}
        deepnvme.save(obj, mnt / "c.pt", handle=handle)
        assert _same(obj, deepnvme.load(mnt / "c.pt", handle=handle))
        staging = torch.empty(1 << 20, dtype=torch.uint8)
        with FastFileWriter(str(mnt / "f.pt"), FastFileWriterConfig(handle, staging)) as w:
            torch.save(obj, w)
        assert _same(obj, torch.load(mnt / "f.pt", weights_only=True))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
