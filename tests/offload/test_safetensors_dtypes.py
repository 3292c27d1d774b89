"""Every dtype the installed safetensors writes is read by deepnvme's safetensors store and
load_safetensors, bit for bit; a dtype this torch cannot represent is a StoreError naming it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is a test extra")

from deepnvme.offload import load_safetensors  # noqa: E402
from deepnvme.offload.stores import StoreError, safetensors_read  # noqa: E402

# torch dtypes safetensors may write; those it refuses (complex128, ...) are skipped below.
CANDIDATES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
              "uint16", "uint32", "uint64", "complex64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
              "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex128"]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes seen as `dtype` (every bit pattern, NaNs included: compared as bytes)."""
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(n))
    return raw.view(dtype).reshape(shape)


def _written() -> dict[str, torch.Tensor]:
    out = {}
    for name in CANDIDATES:
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        t = _tensor(dtype, (3, 4))
        try:
            safetensors_torch.save({"t": t})
        except Exception:  # noqa: BLE001 - a dtype safetensors does not write
            continue
        out[name] = t
    return out


def test_every_dtype_safetensors_writes_is_read_bit_for_bit(tmp_path: Path) -> None:
    tensors = _written()
    assert {"complex64", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"} <= set(
        tensors), "the installed safetensors writes these (0.8); the test would check less than it says"
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    got = load_safetensors(path)
    assert got.keys() == tensors.keys()
    for name, want in tensors.items():
        t = got[name]
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), name


def _file_with(tmp_path: Path, dtype: str, shape: list[int], nbytes: int) -> Path:
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    path = tmp_path / "one.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(nbytes))
    return path


def test_packed_and_missing_dtypes_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StoreError, match="F4 packs 2 values in a byte"):
        load_safetensors(_file_with(tmp_path, "F4", [3, 5], 8))
    with pytest.raises(StoreError, match=r"F4 \[3, 4\] takes 6"):
        load_safetensors(_file_with(tmp_path, "F4", [3, 4], 8))
    monkeypatch.setitem(safetensors_read.DTYPES, "F8_E8M0", None)  # as on a torch without float8_e8m0fnu
    with pytest.raises(StoreError, match=r"dtype F8_E8M0 has no torch dtype in torch .*float8_e8m0fnu"):
        load_safetensors(_file_with(tmp_path, "F8_E8M0", [4], 4))
    with pytest.raises(StoreError, match="unknown dtype 'F12'"):
        load_safetensors(_file_with(tmp_path, "F12", [4], 4))


def test_deepnvme_store_keeps_the_same_dtypes_and_refuses_others_before_writing(tmp_path: Path) -> None:
    from deepnvme.offload import write_store
    from deepnvme.offload.infer.load import read_store
    from deepnvme.offload.stores import open_store

    tensors = {name.replace("_", "-"): t for name, t in _written().items()}
    store = open_store(write_store(tensors, tmp_path / "own"))
    got = read_store(store, list(store.tensors()), torch.device("cpu"), 1 << 20)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype, name
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
    with pytest.raises(TypeError, match="complex32 cannot be kept in a deepnvme store"):
        write_store({"c": torch.zeros(2, dtype=torch.complex32)}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
