"""deepnvme.io.FastFileWriter: DeepSpeed's interface, torch.save's bytes, parallel writers, bad input."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from deepnvme._core.memory import PAGE, memory_of
from deepnvme.io import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter

REPO = Path(__file__).resolve().parents[2]
DS_PYTHON = Path("/work/dsvenv/bin/python")


@pytest.fixture
def handle(aio_module: ModuleType) -> Any:
    return aio_module.aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"w{i}": torch.randn(30_000 + 777 * i, generator=g) for i in range(6)}
    sd["i8"] = torch.randint(-5, 5, (13,), dtype=torch.int8, generator=g)
    sd["step"] = 11
    return sd


def _stream(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _config(handle: Any, staging: int = 1 << 20, **kw: Any) -> FastFileWriterConfig:
    return FastFileWriterConfig(handle, torch.empty(staging, dtype=torch.uint8), **kw)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("staging", [2 * PAGE, 1 << 20])
def test_torch_save_through_the_writer_gives_torch_saves_bytes(tmp_path: Path, handle: Any,
                                                               double_buffer: bool, staging: int) -> None:
    """A staging tensor of one page per buffer (many rotations) or 1 MiB; single and double buffering."""
    sd = _state()
    path = tmp_path / "ckpt.pt"
    fds = _open_fds()
    config = _config(handle, staging + PAGE, double_buffer=double_buffer)
    writer = FastFileWriter(file_path=str(path), config=config)
    torch.save(sd, writer)
    writer.close()
    writer.close()  # idempotent
    assert path.read_bytes() == _stream(sd)
    assert _open_fds() == fds
    assert writer._stats["bytes"] == path.stat().st_size and writer._stats["close"] == 1
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"more")


def test_locked_staging_tensor_and_context_manager(tmp_path: Path, handle: Any) -> None:
    """DeepSpeed's usual staging tensor: a locked buffer from the handle."""
    locked = handle.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    try:
        with FastFileWriter(str(tmp_path / "c.pt"), FastFileWriterConfig(handle, locked)) as writer:
            torch.save(_state(1), writer)
        assert (tmp_path / "c.pt").read_bytes() == _stream(_state(1))
    finally:
        handle.free_cpu_locked_tensor(locked)


def test_a_longer_old_file_loses_its_tail(tmp_path: Path, handle: Any) -> None:
    """DeepSpeed's writer opens without O_TRUNC and keeps the old tail; this one cuts the file."""
    path = tmp_path / "c.pt"
    path.write_bytes(os.urandom(3 << 20))
    with FastFileWriter(str(path), _config(handle)) as w:
        torch.save({"x": torch.arange(10)}, w)
    assert path.read_bytes() == _stream({"x": torch.arange(10)})


def test_storage_object_list_with_and_without_sizes(tmp_path: Path, handle: Any) -> None:
    tensors = [torch.randn(70_000), torch.arange(9, dtype=torch.int16), torch.ones(3, dtype=torch.bfloat16)]
    pairs = [(t.untyped_storage(), t.dtype) for t in tensors]
    for save_size in (True, False):
        path = tmp_path / f"list{save_size}.bin"
        with FastFileWriter(str(path), _config(handle)) as w:
            n = w.save_torch_storage_object_list(pairs, save_size)
        want = b"".join((t.numel().to_bytes(8, "little") if save_size else b"") + bytes(memory_of(t))
                        for t in tensors)
        assert path.read_bytes() == want and n == len(want)
    counted = MockFileWriter(str(tmp_path / "mock.bin")).save_torch_storage_object_list(pairs, True)
    assert counted == len(want) + 8 * len(tensors)


def test_py_and_mock_writers(tmp_path: Path) -> None:
    sd = _state(2)
    py = PyFileWriter(str(tmp_path / "py.pt"))
    torch.save(sd, py)
    py.close()
    assert (tmp_path / "py.pt").read_bytes() == _stream(sd) and py.file_path() == str(tmp_path / "py.pt")
    mock = MockFileWriter(str(tmp_path / "mock.pt"))
    torch.save(sd, mock)
    assert mock._stats["bytes"] == len(_stream(sd)) and (tmp_path / "mock.pt").stat().st_size == 0


def test_bad_configuration_and_paths(tmp_path: Path, handle: Any) -> None:
    staging = torch.empty(1 << 20, dtype=torch.uint8)
    fds = _open_fds()
    cases = [
        (FastFileWriterConfig(handle, staging, num_parallel_writers=0), ValueError, "num_parallel_writers"),
        (_config(handle, num_parallel_writers=2, writer_rank=2), ValueError, "writer_rank"),
        (FastFileWriterConfig(handle, staging, num_parallel_writers="2"), TypeError, "num_parallel_writers"),
        (FastFileWriterConfig(handle, torch.empty(100, dtype=torch.uint8)), ValueError, "pinned_tensor"),
        (FastFileWriterConfig(handle, torch.empty(1 << 20)[::2]), ValueError, "contiguous"),
        (FastFileWriterConfig(handle, bytearray(1 << 20)), TypeError, "pinned_tensor"),
    ]
    for config, error, words in cases:
        with pytest.raises(error, match=words):
            FastFileWriter(str(tmp_path / "x.pt"), config)
    with pytest.raises(FileNotFoundError) as caught:
        FastFileWriter(str(tmp_path / "no" / "x.pt"), FastFileWriterConfig(handle, staging))
    assert caught.value.filename == str(tmp_path / "no" / "x.pt")
    with pytest.raises(IsADirectoryError):
        FastFileWriter(str(tmp_path), FastFileWriterConfig(handle, staging))
    assert _open_fds() == fds


def test_parallel_writers_share_one_file_over_gloo(tmp_path: Path) -> None:
    """Two processes (torch.distributed, gloo) each write their stripes of one torch.save stream, their
    shares of a storage list, and DeepSpeed's per-rank files; rank 0 checks the bytes after a barrier."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    worker = str(REPO / "tests" / "support" / "ffw_workers.py")
    ranks = [subprocess.Popen([sys.executable, worker, str(r), "2", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=180)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(outputs)


# DeepSpeed's CPU accelerator has no utils op, yet its writer's constructor loads one for
# save_torch_storage_object_list, which torch.save never calls: the child hands it a stand-in for that.
DS_CHILD = r"""
import sys, types, torch
import deepspeed.io.fast_file_writer as ffw
from deepspeed.io import FastFileWriter, FastFileWriterConfig
ffw.UtilsBuilder = lambda: types.SimpleNamespace(load=lambda: types.SimpleNamespace(cast_to_byte_tensor=None))
from deepnvme import AsyncIOBuilder
handle = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)
pinned = handle.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
sd = torch.load(sys.argv[1], weights_only=True)
config = FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=pinned)
writer = FastFileWriter(file_path=sys.argv[2], config=config)
torch.save(sd, writer)
writer.close()
"""


def test_same_bytes_as_deepspeeds_fast_file_writer(tmp_path: Path, handle: Any) -> None:
    """DeepSpeed's own FastFileWriter (its venv, our handle underneath) and ours write the same file."""
    if not DS_PYTHON.exists() or subprocess.run([str(DS_PYTHON), "-c", "import deepspeed.io"],
                                                capture_output=True, timeout=300).returncode:
        pytest.skip(f"DeepSpeed is not installed at {DS_PYTHON.parent.parent}")
    if not shutil.which("ninja"):
        pytest.skip("DeepSpeed's writer JIT-builds its utils op, which needs ninja")
    sd = _state(3)
    src, theirs, ours = tmp_path / "src.pt", tmp_path / "ds.pt", tmp_path / "ours.pt"
    torch.save(sd, src)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([str(DS_PYTHON), "-c", DS_CHILD, str(src), str(theirs)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    locked = handle.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    try:
        with FastFileWriter(file_path=str(ours), config=FastFileWriterConfig(dnvme_handle=handle,
                                                                             pinned_tensor=locked)) as w:
            torch.save(sd, w)
    finally:
        handle.free_cpu_locked_tensor(locked)
    assert ours.read_bytes() == theirs.read_bytes() == _stream(sd)
