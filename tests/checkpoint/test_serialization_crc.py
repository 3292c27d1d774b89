"""The CRC-32s deepnvme.save computes itself (torch's own are off) and the prefetching deepnvme.load: the
archive stays valid for zip tools and stock torch.load, every CRC is right in both places a zip keeps it,
and load restores storages exactly as torch.load does, placed for zero-copy O_DIRECT reads."""

from __future__ import annotations

import importlib
import io
import struct
import sys
import zipfile
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepnvme
from deepnvme import serialization
from deepnvme._core import crc as crc_module
from deepnvme._core import saving, zipformat
from deepnvme._core.direct import DIRECT_MIN_BYTES
from deepnvme._core.memory import PAGE
from deepnvme.serialization import prefetch

BIG = DIRECT_MIN_BYTES + 12_345


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _descriptor_crcs(path: Path) -> dict[str, tuple[int, int]]:
    """Each non-empty member's (central directory CRC, data descriptor CRC)."""
    data = path.read_bytes()
    out = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for m in z.infolist():
            if not m.file_size:
                continue
            name_len, extra_len = struct.unpack_from("<HH", data, m.header_offset + 26)
            end = m.header_offset + 30 + name_len + extra_len + m.file_size
            assert data[end:end + 4] == b"PK\x07\x08", m.filename
            out[m.filename] = (m.CRC, struct.unpack_from("<I", data, end + 4)[0])
    return out


def test_zlib_ng_and_zlib_give_the_same_crc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast CRC is zlib's CRC-32 (chained too), and without zlib-ng the module falls back to zlib."""
    blobs = [b"", b"a", bytes(range(256)) * 4099, memoryview(bytearray(b"xyz" * 100_001))[7:]]
    for blob in blobs:
        assert crc_module.crc32(blob) == zlib.crc32(blob)
        assert crc_module.crc32(blob, 0x1234ABCD) == zlib.crc32(blob, 0x1234ABCD)
    monkeypatch.setitem(sys.modules, "zlib_ng", None)  # import fails, as where it is not installed
    fallback = importlib.reload(crc_module)
    try:
        assert fallback.IMPLEMENTATION == "zlib"
        assert all(fallback.crc32(b) == zlib.crc32(b) for b in blobs)
    finally:
        monkeypatch.undo()
        importlib.reload(crc_module)


@pytest.mark.filterwarnings("error")  # the CRC bookkeeping must follow torch's writer without a warning
def test_saved_crcs_are_right_in_descriptors_and_directory(tmp_path: Path, handle: Any) -> None:
    """Payloads of every size, empty storages, and payloads that start like zip records: zip tools find
    every CRC right, descriptor and central directory agree, and stock torch.load reads the file."""
    objs = [
        {"big": torch.randn(BIG // 4), "small": torch.arange(10), "empty": torch.empty(0)},
        {"empty": torch.empty(0)},
        {"e1": torch.empty(0), "e2": torch.empty(0, dtype=torch.int8), "n": 3},
        {"local": _bytes_tensor(b"PK\x03\x04" + bytes(26)), "empty": torch.empty(0)},
        {"empty": torch.empty(0), "central": _bytes_tensor(b"PK\x01\x02" + bytes(BIG))},
        {"descriptor": _bytes_tensor(b"PK\x07\x08" + bytes(12)), "z": torch.zeros(3)},
    ]
    for i, obj in enumerate(objs):
        path = tmp_path / f"{i}.pt"
        deepnvme.save(obj, path, handle=handle)
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None
        pairs = _descriptor_crcs(path)
        assert pairs and all(central == local != 0 for central, local in pairs.values()), pairs
        for loaded in (torch.load(path, weights_only=True), deepnvme.load(path, handle=handle)):
            assert loaded.keys() == obj.keys()
            for k, v in obj.items():
                assert not isinstance(v, torch.Tensor) or torch.equal(loaded[k], v), (i, k)


def test_checksum_false_leaves_the_crcs_zero(tmp_path: Path, handle: Any) -> None:
    path = tmp_path / "n.pt"
    deepnvme.save({"w": torch.randn(BIG // 4)}, path, handle=handle, checksum=False)
    assert {pair for pair in _descriptor_crcs(path).values()} == {(0, 0)}


# How load makes and reads its large payloads' memory: (FILL_FRESH, STAGE_PAYLOADS), and the offset of each
# payload's memory from its file offset's page residue.
MODES = {"fresh": ((True, True), 0), "staged": ((False, True), serialization.STAGED_SHIFT),
         "direct": ((False, False), 0)}


@pytest.mark.parametrize("mode", list(MODES))
def test_loaded_storages_match_torch_loads_and_sit_at_their_file_offset(
        tmp_path: Path, handle: Any, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage sizes, resizability, dtypes, views as torch.load gives them; each large payload's memory is
    at its file offset modulo the page (filled fresh, the default, or read O_DIRECT into place), or
    STAGED_SHIFT bytes past it (memory made the usual way, read through the staging pool), for ours
    (page-aligned) and stock torch.save files (64-aligned). Memory filled fresh is plain memory once load
    returns (no longer registered with userfaultfd)."""
    from deepnvme._core.memory import byte_view
    from deepnvme._core.op import aio_module
    from tests.support.vm import vm_flags

    (fill, staged), shift = MODES[mode]
    if fill and aio_module().fresh_memory_status() != "ok":
        pytest.skip(f"userfaultfd unavailable here: {aio_module().fresh_memory_status()}")
    monkeypatch.setattr(serialization, "FILL_FRESH", fill)
    monkeypatch.setattr(serialization, "STAGE_PAYLOADS", staged)

    base = torch.randn(BIG // 4)
    obj = {"base": base, "view": base[7:1000], "other": torch.randn(BIG // 8 + 1).to(torch.float64),
           "small": torch.arange(5, dtype=torch.int16)}
    for saver in (deepnvme.save, torch.save):
        path = tmp_path / f"{saver.__module__}.pt"
        saver(obj, path)
        data = path.read_bytes()
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            spans = {}  # payload bytes -> file offset
            for m in z.infolist():
                name_len, extra_len = struct.unpack_from("<HH", data, m.header_offset + 26)
                start = m.header_offset + 30 + name_len + extra_len
                spans[data[start:start + m.file_size]] = start
        want = torch.load(path, weights_only=True)
        got = deepnvme.load(path, handle=handle)
        assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
        for k in obj:
            g, w = got[k].untyped_storage(), want[k].untyped_storage()
            assert (g.nbytes(), g.resizable(), got[k].dtype, got[k].stride(), got[k].storage_offset()) == \
                   (w.nbytes(), w.resizable(), want[k].dtype, want[k].stride(), want[k].storage_offset())
            assert torch.equal(got[k], obj[k])
            if g.nbytes() >= serialization.PREFETCH_OWN_BYTES:
                offset = spans[bytes(byte_view(g).numpy())]
                assert g.data_ptr() % PAGE == (offset + shift) % PAGE, (saver, k)
                assert "um" not in vm_flags(g.data_ptr() + PAGE), (saver, k)


@pytest.mark.parametrize("mode", ["fresh", "staged"])
@pytest.mark.parametrize("saver", [deepnvme.save, torch.save])
def test_staged_payloads_load_the_same_bytes_and_still_catch_damage(tmp_path: Path, handle: Any, saver: Any,
                                                                     mode: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The two ways load stages its large payloads through the handle's pool: into memory filled fresh (the
    default), or into memory made the usual way, placed STAGED_SHIFT bytes off its file offset's page residue
    so that the handle does not read it O_DIRECT. Either way the tensors are right, and a byte damaged inside
    a payload's body is still found by its CRC."""
    from deepnvme._core.op import aio_module

    (fill, staged), shift = MODES[mode]
    if fill and aio_module().fresh_memory_status() != "ok":
        pytest.skip(f"userfaultfd unavailable here: {aio_module().fresh_memory_status()}")
    monkeypatch.setattr(serialization, "FILL_FRESH", fill)
    monkeypatch.setattr(serialization, "STAGE_PAYLOADS", staged)
    obj = {"a": torch.randn(BIG // 4), "b": torch.randn(BIG // 8 + 3).to(torch.float64),
           "small": torch.arange(9, dtype=torch.int32)}
    path = tmp_path / "staged.pt"
    saver(obj, path)
    got = deepnvme.load(path, handle=handle)
    assert all(torch.equal(got[k], obj[k]) for k in obj)
    data = bytearray(path.read_bytes())
    at = data.find(obj["a"].numpy().tobytes())
    assert at >= 0
    assert got["a"].data_ptr() % PAGE == (at + shift) % PAGE
    data[at + BIG // 2] ^= 0x40  # inside the page-aligned body, which the handle reads
    path.write_bytes(bytes(data))
    with pytest.raises(deepnvme.CheckpointFormatError, match="CRC-32"):
        deepnvme.load(path, handle=handle)


def test_a_load_filled_fresh_makes_payload_pages_without_faults(tmp_path: Path, handle: Any) -> None:
    """The point of FILL_FRESH: the payloads' pages are made by the fill, not by faults. Memory made the
    usual way, or a read the kernel did into armed memory, would fault each page (a fault the op's
    userfaultfd answers counts as a major one: minor and major are counted)."""
    from deepnvme._core.op import aio_module
    from tests.support.vm import faults

    if not serialization.FILL_FRESH or aio_module().fresh_memory_status() != "ok":
        pytest.skip(f"userfaultfd unavailable here: {aio_module().fresh_memory_status()}")
    obj = {"w": torch.randn(8 << 20)}  # 32 MiB: 8192 pages
    path = tmp_path / "f.pt"
    deepnvme.save(obj, path, handle=handle)
    deepnvme.load(path, handle=handle)  # the staging pool and the op made before counting

    before = faults()
    got = deepnvme.load(path, handle=handle)
    made = faults() - before
    assert torch.equal(got["w"], obj["w"])
    assert made < (32 << 20) // PAGE // 8, made


def test_a_layout_other_than_torchs_is_read_exactly(tmp_path: Path, handle: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the inferred data offsets are wrong (an archive laid out differently), load notices it on the
    local headers and reads the archive again with every header read: the result is still right."""
    obj = {"w": torch.randn(BIG // 4), "s": torch.arange(9)}
    path = tmp_path / "a.pt"
    deepnvme.save(obj, path, handle=handle)
    infer = zipformat._inferred_offset
    monkeypatch.setattr(zipformat, "_inferred_offset",
                        lambda m, following: None if (o := infer(m, following)) is None else o - 64)
    got = deepnvme.load(path, handle=handle)
    assert all(torch.equal(got[k], obj[k]) for k in obj)


def test_byte_swapped_loads_copy_into_torchs_memory(tmp_path: Path, handle: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch byte-swaps a payload (the file's byte order is not this machine's), it does so in its
    own storage before map_location sees it: load fills that storage rather than handing its own over."""
    obj = {"w": torch.randn(BIG // 4), "i": torch.arange(1000, dtype=torch.int32)}
    path = tmp_path / "a.pt"
    deepnvme.save(obj, path, handle=handle)
    monkeypatch.setattr(sys, "byteorder", "big")
    want = torch.load(path, weights_only=True)
    got = deepnvme.load(path, handle=handle)
    monkeypatch.undo()
    assert not torch.equal(want["i"], obj["i"])  # torch did swap
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in obj)


def test_empty_at_residue_checks_its_arguments(aio_module: ModuleType) -> None:
    t = aio_module.empty_at_residue(3 * PAGE + 5, 64)
    assert t.dtype == torch.uint8 and t.numel() == 3 * PAGE + 5 and t.data_ptr() % PAGE == 64
    assert not t.untyped_storage().resizable()
    assert aio_module.empty_at_residue(0, 0).numel() == 0
    for nbytes, residue in ((-1, 0), (10, -1), (10, PAGE)):
        with pytest.raises(ValueError, match="nbytes|residue"):
            aio_module.empty_at_residue(nbytes, residue)


def test_replacing_a_file_frees_it_after_the_rename(tmp_path: Path, handle: Any) -> None:
    """The replaced file is held open across the rename and closed on another thread: no descriptor
    stays open once that is done, the new content is there, and no other file is left."""
    path = tmp_path / "c.pt"
    deepnvme.save({"w": torch.randn(BIG)}, path, handle=handle)
    saving._join_closers()
    before = _fds()
    new = {"w": torch.randn(BIG // 2)}
    deepnvme.save(new, path, handle=handle)
    saving._join_closers()
    assert _fds() - before == set()  # (other tests' objects may close theirs meanwhile)
    assert torch.equal(deepnvme.load(path, handle=handle)["w"], new["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.parametrize("verify", [True, False])
def test_failed_loads_leave_no_descriptor_open(tmp_path: Path, handle: Any, verify: bool) -> None:
    """A damaged payload (found by its CRC) or a pickle torch rejects: the error, and no descriptor left
    open by the read-ahead (its O_DIRECT reopen included)."""
    path = tmp_path / "c.pt"
    deepnvme.save({"w": torch.randn(BIG), "o": Opaque()}, path, handle=handle)
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.pt"
    data[len(data) // 2] ^= 0x5A
    bad.write_bytes(bytes(data))
    before = _fds()
    if verify:
        with pytest.raises(serialization.CheckpointFormatError, match="CRC-32"):
            deepnvme.load(bad, handle=handle)
    with pytest.raises(Exception, match="Weights only load failed"):
        deepnvme.load(path, handle=handle, verify=verify)
    assert _fds() - before == set()  # (other tests' objects may close theirs meanwhile)


def _fds() -> set[tuple[str, str]]:
    """This process's open descriptors with what they point at."""
    import os

    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, gone by now
            pass
    return out


class Opaque:
    """Not allowed by weights_only=True."""


@pytest.mark.parametrize("damaged", [False, True])
def test_many_read_batches_on_two_handles(tmp_path: Path, aio_module: ModuleType,
                                          monkeypatch: pytest.MonkeyPatch, damaged: bool) -> None:
    """Batches far smaller than the payloads, shrinking towards the end: the reads alternate between the
    default handle and this thread's second one, each batch's CRCs are checked while the next is read, a
    damaged member stops the load with its name, and an intact file loads exactly."""
    monkeypatch.setattr(serialization, "BATCH_BYTES", 16 * PAGE)
    monkeypatch.setattr(serialization, "TAIL_BATCH_BYTES", 2 * PAGE)  # and shrinking towards the end
    obj = {f"w{i}": torch.randn(BIG // 4 + 1000 * i) for i in range(6)} | {"s": torch.arange(9)}
    path = tmp_path / "m.pt"
    deepnvme.save(obj, path)
    if damaged:
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x5A
        path.write_bytes(bytes(data))
        with pytest.raises(serialization.CheckpointFormatError, match="CRC-32") as caught:
            deepnvme.load(path)
        assert caught.value.filename == str(path)
    else:
        got = deepnvme.load(path)
        assert all(torch.equal(got[k], obj[k]) for k in obj)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 64 << 20), min_size=1, max_size=60), st.sampled_from([1 << 20, 256 << 20]))
def test_read_batches_shrink_towards_the_end(sizes: list[int], batch_bytes: int) -> None:
    """Load's reads in batches, in file order: a batch ends with the read that brings it to BATCH_BYTES or
    half of what was left when it began, whichever is less, but TAIL_BATCH_BYTES at least; so the last one
    is short (under TAIL_BATCH_BYTES before its last read, or mostly that one read) and little CRC checking
    is left once every read has ended."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serialization, "BATCH_BYTES", batch_bytes)
        got = prefetch._batches(sizes)
        assert prefetch._batches([]) == []
    assert got[0] == 0 and all(b - a in (0, 1) for a, b in zip(got, got[1:]))
    per: dict[int, list[int]] = {}
    for n, b in zip(sizes, got):
        per.setdefault(b, []).append(n)
    tail = serialization.TAIL_BATCH_BYTES
    left = sum(sizes)
    for b, members in sorted(per.items()):
        limit = min(batch_bytes, max(tail, left // 2))
        assert sum(members[:-1]) < limit
        if b != got[-1]:
            assert sum(members) >= limit
        left -= sum(members)
    last = per[got[-1]]
    assert sum(last[:-1]) < tail or last[-1] > sum(last) // 2
