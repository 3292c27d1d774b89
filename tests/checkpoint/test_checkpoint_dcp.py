"""deepnvme.checkpoint: the DCP backend on the aio_handle, against stock DCP, in 1, 2 and 4 real processes."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import dcp_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from deepnvme.checkpoint import ALIGNMENT, INLINE_BELOW, AioStorageReader, AioStorageWriter, checkpoint_files

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    """Every dtype, views, an empty tensor, small and large tensors, and non-tensor values."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300_001, generator=g)
    sd: dict[str, Any] = {
        "big": big,  # larger than INLINE_BELOW: payload through O_DIRECT, odd length
        "slice": big[7:70_007],  # a view into a larger storage
        "transposed": torch.randn(513, 129, generator=g).t(),  # dense, non-contiguous
        "bf16": torch.randn(1024, 40, generator=g).to(torch.bfloat16),
        "half": torch.randn(33, generator=g).half(),
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "c64": torch.randn(40_000, generator=g, dtype=torch.complex64),
        "i64": torch.arange(-50, 50),
        "i8": torch.arange(-100, 100, dtype=torch.int8),
        "u8": torch.arange(0, 255, dtype=torch.uint8),
        "bool": torch.rand(70_000, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "step": 7,
        "name": "run-1",
        "nested": {"lr": 0.1, "t": torch.ones(2, 2)},
    }
    return sd


def _blank(sd: dict[str, Any]) -> dict[str, Any]:
    """Same structure, tensors zeroed (or emptied of a Python value), for dcp.load to fill."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, dict):
            out[k] = _blank(v)
        else:
            out[k] = None
    return out


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        elif isinstance(v, dict):
            _check(got[k], v)
        else:
            assert got[k] == v, k


def _load(directory: Path, reader_cls: type, sd: dict[str, Any]) -> dict[str, Any]:
    out = _blank(sd)
    dcp.load(out, storage_reader=reader_cls(directory))
    return out


@pytest.mark.parametrize("thread_count", [1, 3])
def test_ours_read_by_stock_and_ours(tmp_path: Path, thread_count: int) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c", thread_count=thread_count))
    assert len(checkpoint_files(tmp_path / "c")) == thread_count
    _check(_load(tmp_path / "c", FileSystemReader, sd), sd)
    _check(_load(tmp_path / "c", AioStorageReader, sd), sd)


def test_many_small_tensors(tmp_path: Path) -> None:
    """Small tensors travel in the gap buffers; past 8 MiB of them the gap is written out in between."""
    g = torch.Generator().manual_seed(1)
    sd = {f"p{i}": torch.randn(15_000 + i, generator=g) for i in range(300)}  # ~18 MB, each below 64 KiB
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c"))
    _check(_load(tmp_path / "c", FileSystemReader, sd), sd)
    _check(_load(tmp_path / "c", AioStorageReader, sd), sd)


@pytest.mark.parametrize("writer", [AioStorageWriter, FileSystemWriter])
def test_many_archives_with_byte_items_whole_and_in_part(tmp_path: Path, writer: type) -> None:
    """A hundred archives with non-tensor items among them, loaded whole and in part: every tensor right;
    an archive damaged far into the file is named."""
    g = torch.Generator().manual_seed(3)
    sd: dict[str, Any] = {}
    for i in range(101):
        sd[f"w{i:03d}"] = torch.randn(200 + i, 100 + i % 3, generator=g)  # payloads past INLINE_BELOW
        if i % 10 == 0:
            sd[f"step{i:03d}"] = i  # a byte item between the archives
    dcp.save(sd, storage_writer=writer(tmp_path / "c"))
    _check(_load(tmp_path / "c", AioStorageReader, sd), sd)
    part = {k: v for n, (k, v) in enumerate(sd.items()) if n % 3 == 1}
    _check(_load(tmp_path / "c", AioStorageReader, part), part)
    data = _wipe_archive_ends(tmp_path / "c", "w067")
    with pytest.raises(CheckpointException, match=f"{data}: item 'w067' .* not a readable torch.save"):
        _load(tmp_path / "c", AioStorageReader, sd)


def _wipe_archive_ends(directory: Path, fqn: str) -> Path:
    """Overwrite item `fqn`'s first records and its directory, as a torn or overwritten file would have
    them; returns its data file."""
    with open(directory / ".metadata", "rb") as f:
        md = pickle.load(f)
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    data = directory / info.relative_path
    with open(data, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff" * 512)
        f.seek(info.offset + info.length - 200)
        f.write(b"\xff" * 200)
    return data


def _same_shapes() -> list[torch.Tensor]:
    """Tensors that share a shape and differ in what else torch.save records about them."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 70_000, generator=g)
    return [torch.randn(70_000, generator=g), torch.randn(70_000, generator=g),
            torch.randn(70_000, generator=g).double(), base[1], base[2], base.t()[0],
            torch.randn(70_000, generator=g).requires_grad_(), torch.nn.Parameter(torch.randn(70_000)),
            torch.randn(70_000, generator=g, dtype=torch.complex64).conj()]


def test_archives_laid_out_once_per_layout_match_torch() -> None:
    """A layout reused for a tensor of the same layout is byte for byte what torch.save lays out for it."""
    from deepnvme.checkpoint.archive_layout import archive_of, lay_out

    laid_out: dict = {}
    for t in _same_shapes():
        archive_of(t, laid_out)
    assert 4 < len(laid_out) < len(_same_shapes())  # some layouts repeat, others do not
    for t in _same_shapes():
        assert archive_of(t, laid_out) == lay_out(t)


def test_repeated_shapes_read_by_stock_and_ours(tmp_path: Path) -> None:
    sd = {f"t{i}": t.detach().resolve_conj() for i, t in enumerate(_same_shapes())}
    sd |= {f"layer{i}.w": torch.full((300, 300), float(i)) for i in range(12)}
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c"))
    _check(_load(tmp_path / "c", FileSystemReader, sd), sd)
    _check(_load(tmp_path / "c", AioStorageReader, sd), sd)


def test_stock_read_by_ours(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "c", thread_count=2))
    _check(_load(tmp_path / "c", AioStorageReader, sd), sd)


def test_one_file_per_item_and_dcp_to_torch_save(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c", single_file_per_rank=False))
    dcp_to_torch_save(tmp_path / "c", tmp_path / "all.pt")
    _check(torch.load(tmp_path / "all.pt", weights_only=True), sd)


def test_payloads_aligned_and_no_temporaries(tmp_path: Path) -> None:
    """Large payloads sit on 4 KiB file offsets (so they go O_DIRECT from the tensor), files are whole
    blocks, nothing temporary survives, and saving again replaces the checkpoint."""
    directory = tmp_path / "c"
    dcp.save({"x": torch.ones(5)}, storage_writer=AioStorageWriter(directory))
    sd = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FileSystemWriter's "overwriting" notice
        dcp.save(sd, storage_writer=AioStorageWriter(directory))
    assert sorted(p.name for p in directory.iterdir()) == [".metadata", "__0_0.distcp"]
    with open(directory / ".metadata", "rb") as f:
        md = pickle.load(f)
    data = directory / "__0_0.distcp"
    assert data.stat().st_size % ALIGNMENT == 0
    aligned = 0
    with open(data, "rb") as f:
        for index, info in md.storage_data.items():
            f.seek(info.offset)
            item = f.read(info.length)
            if index.fqn in ("step", "name", "nested.lr"):
                continue
            meta = torch.load(_io_bytes(item), map_location="meta", weights_only=True)
            storage = meta.untyped_storage()
            if storage.nbytes() >= INLINE_BELOW:
                assert (info.offset + storage._checkpoint_offset) % ALIGNMENT == 0, index.fqn
                aligned += 1
    assert aligned >= 5
    _check(_load(directory, FileSystemReader, sd), sd)


def _io_bytes(b: bytes) -> Any:
    import io

    return io.BytesIO(b)


def test_temporaries_of_a_killed_save_are_removed(tmp_path: Path) -> None:
    """deepnvme's one atomic-replace recipe: a save removes the temporaries of its files that processes of
    this host left and that are gone; one of a live process (another rank saving) stays."""
    from op_builder.atomic_file import _HOST, TEMP_SUFFIX

    directory = tmp_path / "c"
    directory.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = [directory / f".{name}.{_HOST}.{dead.stdout.strip()}.0badf00d{TEMP_SUFFIX}"
             for name in ("__0_0.distcp", ".metadata")]
    for p in stale:
        p.write_bytes(b"half a file")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # killed below
    try:
        other_rank = directory / f".__0_0.distcp.{_HOST}.{live.pid}.0badf00d{TEMP_SUFFIX}"
        other_rank.write_bytes(b"not ours to remove")
        dcp.save({"x": torch.ones(5)}, storage_writer=AioStorageWriter(directory))
        assert not any(p.exists() for p in stale) and other_rank.exists()
    finally:
        live.kill()
        live.wait()


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    sd = _state()
    dcp.save(sd, storage_writer=AioStorageWriter(directory))
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    broken = {"big": torch.zeros(300_001), "m": torch.empty(100_000, device="meta")}  # meta: no data to copy
    with warnings.catch_warnings(), pytest.raises(CheckpointException, match="meta"):
        warnings.simplefilter("ignore")
        dcp.save(broken, storage_writer=AioStorageWriter(directory))
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    _check(_load(directory, AioStorageReader, sd), sd)


def test_full_disk_raises_enospc_and_keeps_previous(full_fs: Path) -> None:  # noqa: F811
    """On a 16 MiB file system: a save that does not fit raises ENOSPC naming the checkpoint, removes its
    temporary files, and the checkpoint saved there before still loads."""
    directory = full_fs / "c"
    small = {"w": torch.randn(1 << 18)}
    dcp.save(small, storage_writer=AioStorageWriter(directory))
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as exc:
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(6 << 20)}, storage_writer=AioStorageWriter(directory))
    assert "No space left on device" in str(exc.value) and str(directory) in str(exc.value)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    _check(_load(directory, AioStorageReader, small), small)


def test_file_system_without_o_direct(ramfs: Path) -> None:  # noqa: F811
    """ramfs refuses O_DIRECT: the backend falls back to buffered I/O and stays readable by stock DCP."""
    sd = _state()
    dcp.save(sd, storage_writer=AioStorageWriter(ramfs / "c"))
    _check(_load(ramfs / "c", FileSystemReader, sd), sd)
    _check(_load(ramfs / "c", AioStorageReader, sd), sd)


def test_missing_directory_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointException, match=str(missing)):
        dcp.load({"x": torch.zeros(3)}, storage_reader=AioStorageReader(missing))


def test_truncated_file_names_it(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c"))
    data = checkpoint_files(tmp_path / "c")[0]
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CheckpointException, match=f"{data}: truncated"):
        _load(tmp_path / "c", AioStorageReader, sd)


def test_corrupted_archive_names_it(tmp_path: Path) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c"))
    data = _wipe_archive_ends(tmp_path / "c", "big")
    with pytest.raises(CheckpointException, match=f"{data}: item 'big' .* not a readable torch.save archive"):
        _load(tmp_path / "c", AioStorageReader, sd)


def _repeated_structures() -> dict[str, torch.Tensor]:
    """Five tensors of one shape and dtype, one of them non-contiguous, and two of another dtype."""
    g = torch.Generator().manual_seed(1)
    sd = {f"w{i}": torch.randn(96, 160, generator=g) for i in range(4)}
    sd["wt"] = torch.randn(160, 96, generator=g).t()  # same shape, other strides: another pickle
    sd |= {f"h{i}": torch.randn(96, 160, generator=g).half() for i in range(2)}
    return sd


@pytest.mark.parametrize("writer", [AioStorageWriter, FileSystemWriter])
def test_items_of_one_structure_are_parsed_once(tmp_path: Path, writer: type,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.load parses one item per structure (pickle, records); the others take its result and their own
    payload offsets, and every tensor still loads right (its strides included)."""
    import deepnvme.checkpoint.reader as backend

    sd = _repeated_structures()
    dcp.save(sd, storage_writer=writer(tmp_path / "c"))
    parsed = []
    real = backend._parse_item

    def counting(*args: Any) -> Any:
        parsed.append(args[3].storage_index.fqn)
        return real(*args)

    monkeypatch.setattr(backend, "_parse_item", counting)
    got = _load(tmp_path / "c", AioStorageReader, sd)
    _check(got, sd)
    assert len(parsed) == 3, parsed  # float32 contiguous, float32 transposed, float16


def test_a_damaged_pickle_among_repeated_structures_is_refused(tmp_path: Path) -> None:
    """An item whose pickle differs from the others of its shape is parsed on its own: its damage is found."""
    import io
    import struct
    import zipfile

    sd = _repeated_structures()
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c"))
    with open(tmp_path / "c" / ".metadata", "rb") as f:
        md = pickle.load(f)
    infos = sorted((v for k, v in md.storage_data.items() if k.fqn.startswith("w") and k.fqn != "wt"),
                   key=lambda v: v.offset)
    info = infos[-1]  # parsed after the others of its structure
    data = tmp_path / "c" / info.relative_path
    raw = bytearray(data.read_bytes())
    item = bytes(raw[info.offset:info.offset + info.length])
    with zipfile.ZipFile(io.BytesIO(item)) as z:
        member = next(m for m in z.infolist() if m.filename.endswith("/data.pkl"))
    name_len, extra_len = struct.unpack_from("<HH", item, member.header_offset + 26)
    at = info.offset + member.header_offset + 30 + name_len + extra_len
    raw[at] ^= 0xFF  # the pickle's first opcode
    data.write_bytes(bytes(raw))
    fqn = next(k.fqn for k, v in md.storage_data.items() if v is info)
    with pytest.raises(CheckpointException, match=f"item '{fqn}' .* not a readable torch.save archive"):
        _load(tmp_path / "c", AioStorageReader, sd)


def test_garbage_metadata_names_it(tmp_path: Path) -> None:
    dcp.save({"x": torch.ones(3)}, storage_writer=AioStorageWriter(tmp_path / "c"))
    (tmp_path / "c" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointException, match="not a readable DCP metadata file"):
        dcp.load({"x": torch.zeros(3)}, storage_reader=AioStorageReader(tmp_path / "c"))


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="thread_count"):
        AioStorageWriter(tmp_path, thread_count=0)
    with pytest.raises(ValueError, match="queue_depth"):
        AioStorageWriter(tmp_path, queue_depth=-1)
    with pytest.raises(ValueError, match="intra_op_parallelism"):
        AioStorageReader(tmp_path, intra_op_parallelism=0)
    with pytest.raises(TypeError, match="path"):
        AioStorageWriter(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path"):
        AioStorageReader(None)  # type: ignore[arg-type]
    # The handle settings are checked once, in deepnvme._core.handles, when the writer is made: beyond a
    # handle's limits, of the wrong type, or unknown, before any save starts.
    with pytest.raises(ValueError, match="queue_depth"):
        AioStorageWriter(tmp_path, queue_depth=100000)
    with pytest.raises(TypeError, match="thread_count"):
        AioStorageWriter(tmp_path, thread_count=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_size"):
        AioStorageReader(tmp_path, block_size="1M")  # type: ignore[arg-type]


def test_given_handle_is_used(tmp_path: Path, aio_module: Any) -> None:
    h = aio_module.aio_handle(block_size=1 << 16, queue_depth=8, intra_op_parallelism=1)
    sd = {"w": torch.randn(100_000)}
    writer = AioStorageWriter(tmp_path / "c", handle=h)
    dcp.save(sd, storage_writer=writer)
    assert writer.handle is h
    back = {"w": torch.zeros(100_000)}
    dcp.load(back, storage_reader=AioStorageReader(tmp_path / "c", handle=h))
    assert torch.equal(back["w"], sd["w"])


def test_save_at_4_load_at_2_resharded(tmp_path: Path) -> None:
    """DTensors saved by 4 gloo ranks (ours and stock FileSystemWriter) load at 2 ranks with other shardings,
    through both readers."""
    ours, stock = str(tmp_path / "ours"), str(tmp_path / "stock")
    dcp_workers.run(4, dcp_workers.save_world, ours, stock)
    assert len(checkpoint_files(ours)) == 8  # 2 files (thread_count) per rank
    dcp_workers.run(2, dcp_workers.load_world, [ours, stock])


def test_async_save_during_training(tmp_path: Path) -> None:
    dcp_workers.run(2, dcp_workers.async_world, str(tmp_path / "c"))


class _CountingHandle:
    """A real handle whose async_pread calls are counted (the reader's requests)."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.reads = handle, []

    def async_pread(self, buf: torch.Tensor, fd: int, offset: int) -> int:
        self.reads.append((offset, buf.numel()))
        return self.handle.async_pread(buf, fd, offset)

    def wait(self) -> int:
        return self.handle.wait()


def _queued_edges(path: Path, handle: Any, archives: list[tuple[int, int]]) -> tuple[list[Any], list]:
    """_queue_edges over `archives` of the file at `path` through a real handle, waited for: the edges
    and the reads it made."""
    import deepnvme.checkpoint.reader as backend

    counting = _CountingHandle(handle)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        found = backend._queue_edges(counting, fd, archives)
        counting.wait()
    finally:
        os.close(fd)
    return found, counting.reads


def _check_edges(data: torch.Tensor, archives: list[tuple[int, int]], found: list[Any]) -> None:
    """Each archive's edges hold the file's bytes at its place, and bytes_at answers, with exactly those
    bytes, for every range its ends hold and for no other: probed at and around every boundary (the
    start, the head's end, the tail's start, the end, and before the start)."""
    import deepnvme.checkpoint.reader as backend

    for (offset, length), edges in zip(archives, found):
        want = data[offset:offset + length]
        head = min(length, backend.EDGE)
        assert edges.head.numel() in (head, length)
        assert torch.equal(edges.head, want[:edges.head.numel()])
        assert torch.equal(edges.tail, want[edges.tail_at:edges.tail_at + edges.tail.numel()])
        if edges.head.numel() < length:
            assert edges.tail_at == max(head, length - backend.EDGE)
            assert edges.tail_at + edges.tail.numel() == length
        held = [(0, edges.head.numel()), (edges.tail_at, edges.tail_at + edges.tail.numel())]
        marks = {0, head, edges.tail_at, length, edges.head.numel()}
        for a in sorted({m + d for m in marks for d in (-2, -1, 0, 1)}):
            for n in (0, 1, 2, 17, backend.EDGE):
                got = edges.bytes_at(a, n)
                inside = any(lo <= a and a + n <= hi for lo, hi in held) and a >= 0
                if got is None:
                    assert not inside, f"bytes [{a}, {a + n}) of a {length}-byte archive are held, not given"
                else:
                    assert 0 <= a and a + n <= length, f"bytes [{a}, {a + n}) given, outside the archive"
                    assert torch.equal(got, want[a:a + n]), (a, n, length)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.lists(st.tuples(st.integers(-20_000, 40_000), st.integers(0, 30_000)), min_size=1,
                       max_size=12))
def test_archive_ends_are_the_files_bytes_whatever_the_layout(tmp_path: Path, handle: Any,
                                                               layout: list[tuple[int, int]]) -> None:
    """Archives adjacent, apart, overlapping, empty or at the end of the file: each one's ends (and the
    whole of it, where one read holds it) are the file's bytes at its place, and bytes_at never answers
    for bytes it does not hold."""
    import deepnvme.checkpoint.reader as backend

    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "archives"
    path.write_bytes(data.numpy().tobytes())
    at, archives = 0, []
    for step, length in layout:  # a negative step overlaps the archive before
        at = max(0, at + step)
        archives.append((at, min(length, data.numel() - at)))
        at += length
    archives.append((data.numel() - 5000, 5000))  # one that ends where the file does
    found, reads = _queued_edges(path, handle, archives)
    assert len(reads) <= 2 * len(archives)
    assert all(n <= backend.EDGE_READ_MAX for _, n in reads)
    _check_edges(data, archives, found)


def test_merged_edge_reads_stop_at_their_cap(tmp_path: Path, handle: Any) -> None:
    """Small archives side by side over more than EDGE_READ_MAX bytes (and the same archive named again
    and again): the merged reads never pass the cap, never read a byte twice beyond one end's overlap,
    and every archive's bytes are still right."""
    import deepnvme.checkpoint.reader as backend

    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "archives"
    path.write_bytes(data.numpy().tobytes())
    # 2.5 MiB of 6000-byte archives (head 4096 bytes, tail 1904): the cap falls between an archive's head
    # and its tail (archive 174's), whose ends then come from two reads.
    archives = [(at, 6000) for at in range(0, (5 << 20) // 2, 6000)]
    small = len(archives)
    archives += [(1 << 20, 1 << 20)] * 1000  # one 1 MiB range named a thousand times
    found, reads = _queued_edges(path, handle, archives)
    assert all(n <= backend.EDGE_READ_MAX for _, n in reads), sorted(n for _, n in reads)[-3:]
    # Three reads of at most 1 MiB, overlapping by less than an end: a range named many times is read once.
    assert len(reads) == 3 and sum(n for _, n in reads) <= (5 << 20) // 2 + 2 * backend.EDGE, reads
    assert found[174].head.numel() == backend.EDGE  # split by the cap
    _check_edges(data, archives[:small + 2], found[:small + 2])


def test_small_items_come_with_the_archive_ends(tmp_path: Path, handle: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A small item's payload lies in its archive's ends, read together with its neighbours': it is copied
    from there, not read again; only the large payloads are requests of their own."""

    g = torch.Generator().manual_seed(4)
    sd = {}
    for i in range(6):
        sd[f"w{i}"] = torch.randn(256, 1024, generator=g)  # 1 MiB: a payload read of its own
        sd[f"b{i}"] = torch.randn(1024 + i, generator=g)  # 4 KiB: inside its archive's ends
        sd[f"n{i}"] = torch.randn(3, generator=g)
    dcp.save(sd, storage_writer=AioStorageWriter(tmp_path / "c"))
    counting = _CountingHandle(handle)
    monkeypatch.setattr(AioStorageReader, "handle", property(lambda self: counting))
    _check(_load(tmp_path / "c", AioStorageReader, sd), sd)
    payloads = [n for _, n in counting.reads if n == 1 << 20]
    assert len(payloads) == 6
    # The ends: one read per run of neighbours, not two per item.
    assert len(counting.reads) - len(payloads) <= 7, counting.reads
