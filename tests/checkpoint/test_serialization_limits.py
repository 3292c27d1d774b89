"""deepnvme.load and deepnvme.save at the process's limits (address space, descriptors) and with the file
truncated under a load: each failure names the file and says what really went wrong.

The limits are real ones (resource.setrlimit), set in a child process so that the test run keeps its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import deepnvme
from deepnvme import CheckpointFormatError

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, *args: str) -> str:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


_OUT_OF_MEMORY = """
    import errno, gc, resource, sys
    import torch, deepnvme
    from deepnvme import CheckpointFormatError
    path = sys.argv[1]
    deepnvme.load(path); gc.collect()
    vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) << 10
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    seen = set()
    for headroom in range(0, 200 << 20, 6 << 20):
        resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, hard))
        try:
            deepnvme.load(path)
            seen.add("ok")
        except MemoryError as exc:
            assert path in str(exc), exc
            seen.add("MemoryError")
        except OSError as exc:
            assert exc.errno == errno.ENOMEM and exc.filename == path, exc
            seen.add("ENOMEM")
        except CheckpointFormatError as exc:
            raise AssertionError(f"an intact file called damaged with {headroom >> 20} MiB to spare: {exc}")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            gc.collect()
    print(sorted(seen))
"""


def test_load_out_of_memory_is_a_memory_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "one.pt"
    deepnvme.save({"w": torch.ones(16 << 20)}, path)  # one 64 MiB tensor
    seen = _child(_OUT_OF_MEMORY, str(path))
    assert "ok" in seen and ("MemoryError" in seen or "ENOMEM" in seen), seen  # the limit was met, and passed


_NO_DESCRIPTORS = """
    import errno, gc, os, resource, sys
    import torch, deepnvme
    src, out = sys.argv[1], sys.argv[2]
    state = torch.load(src)
    deepnvme.load(src); deepnvme.save(state, out); gc.collect()
    before = os.stat(out).st_ino
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    seen = set()
    for free in range(12):
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        fill = []
        while True:
            try:
                fill.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        for _ in range(free):
            os.close(fill.pop())
        for what, path, run in (("load", src, lambda: deepnvme.load(src)),
                                ("save", out, lambda: deepnvme.save(state, out))):
            try:
                run()
                seen.add(what + " ok")
            except OSError as exc:
                assert exc.errno == errno.EMFILE and exc.filename == path, f"{what}, {free} free: {exc!r}"
                seen.add(what + " EMFILE")
        for fd in fill:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert sorted(os.listdir(os.path.dirname(out))) == sorted(["src.pt", "out.pt"])  # no temporary left
    assert os.stat(out).st_ino == before or "save ok" in seen  # a failed save left the old file in place
    got = torch.load(out)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    print(sorted(seen))
"""


def test_no_descriptors_left_is_emfile_naming_the_file(tmp_path: Path) -> None:
    src, out = tmp_path / "src.pt", tmp_path / "out.pt"
    torch.save({f"t{i}": torch.full((100_000 + i,), float(i)) for i in range(12)}, src)
    seen = _child(_NO_DESCRIPTORS, str(src), str(out))
    assert "save EMFILE" in seen and "load EMFILE" in seen, seen


def test_a_file_truncated_while_read_is_reported_as_truncated(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated while load's first read is in flight: the fault engine holds that block until the file is
    shorter, so the reads meet the new end (the handle reports EIO) whatever the machine's speed."""
    from deepnvme._core.op import aio_module

    path = tmp_path / "t.pt"
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(3)}  # 12 MiB: one batch of reads
    deepnvme.save(state, path)
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("DEEPNVME_FAULT", "hold@1")
    monkeypatch.setenv("DEEPNVME_FAULT_GATE", str(gate))
    handle = aio_module().aio_handle(1 << 20, 8, False, False, 1, engine="fault")

    def truncate_while_held() -> None:
        give_up = time.monotonic() + 60
        while not (gate / "held.1").exists() and time.monotonic() < give_up:
            time.sleep(0.001)
        os.truncate(path, 1 << 20)
        (gate / "go.1").touch()

    truncator = threading.Thread(target=truncate_while_held)
    truncator.start()
    try:
        with pytest.raises(CheckpointFormatError, match="truncated") as caught:
            deepnvme.load(path, handle=handle)
    finally:
        (gate / "go.1").touch()
        truncator.join()
    assert os.path.getsize(path) == 1 << 20  # the truncation came while the load was reading
    assert caught.value.filename == str(path) and "shorter" in str(caught.value)
