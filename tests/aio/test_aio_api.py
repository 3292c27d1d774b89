"""async_io API surface: constructor defaults and order, getters, engine selection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from builder_helpers import REPO_ROOT

# Every real engine the library knows, in its order of preference (as conftest.ENGINES).
ENGINES = ("io_uring", "libaio", "posix")

METHODS = (
    "get_block_size", "get_queue_depth", "get_single_submit", "get_overlap_events",
    "get_intra_op_parallelism", "get_alignment", "get_engine", "read", "write", "pread", "pwrite",
    "sync_pread", "sync_pwrite", "async_pread", "async_pwrite", "wait", "new_cpu_locked_tensor",
    "free_cpu_locked_tensor", "is_pinned",
)


def test_module_exports(aio_module: ModuleType) -> None:
    """The module offers DeepSpeed's names plus the engine queries."""
    for name in ("aio_handle", "aio_read", "aio_write", "available_engines", "engine_status"):
        assert hasattr(aio_module, name), name
    h = aio_module.aio_handle()
    for name in METHODS:
        assert callable(getattr(h, name)), name


def test_defaults(aio_module: ModuleType, available_engines: list[str]) -> None:
    """A handle built without arguments has DeepSpeed's defaults and the preferred engine."""
    h = aio_module.aio_handle()
    assert h.get_block_size() == 1048576
    assert h.get_queue_depth() == 128
    assert h.get_single_submit() is False
    assert h.get_overlap_events() is False
    assert h.get_intra_op_parallelism() == 1
    assert h.get_engine() == available_engines[0]


@pytest.mark.parametrize("single_submit", [True, False])
@pytest.mark.parametrize("overlap_events", [True, False])
@pytest.mark.parametrize("par", [1, 2, 3])
def test_positional_and_keyword_construction(
    aio_module: ModuleType, engine: str, single_submit: bool, overlap_events: bool, par: int
) -> None:
    """Positional order and keyword names are DeepSpeed's; getters return what was passed."""
    a = aio_module.aio_handle(4096, 16, single_submit, overlap_events, par, engine)
    b = aio_module.aio_handle(
        block_size=4096, queue_depth=16, single_submit=single_submit, overlap_events=overlap_events,
        intra_op_parallelism=par, engine=engine,
    )
    for h in (a, b):
        assert h.get_block_size() == 4096
        assert h.get_queue_depth() == 16
        assert h.get_single_submit() is single_submit
        assert h.get_overlap_events() is overlap_events
        assert h.get_intra_op_parallelism() == par
        assert h.get_engine() == engine
        align = h.get_alignment()
        assert isinstance(align, int) and align > 0 and align % 512 == 0


def test_available_engines_and_status(aio_module: ModuleType) -> None:
    """available_engines() is ordered by preference, posix always works, status agrees with it."""
    avail = list(aio_module.available_engines())
    status = dict(aio_module.engine_status())
    assert avail, "no engine available"
    assert "posix" in avail, "the thread-pool engine must always be usable"
    assert set(avail) <= set(ENGINES)
    assert avail == [e for e in ENGINES if e in avail], "not in preference order"
    for name in ENGINES:
        assert name in status, name
        assert isinstance(status[name], str) and status[name]
        assert (status[name] == "ok") == (name in avail), (name, status[name])


@pytest.mark.parametrize("name", ENGINES)
def test_forcing_unavailable_engine_raises(aio_module: ModuleType, name: str) -> None:
    """Forcing an engine that cannot run raises RuntimeError naming it and the reason."""
    if name in aio_module.available_engines():
        pytest.skip(f"{name} is available here")
    reason = aio_module.engine_status()[name]
    with pytest.raises(RuntimeError) as exc:
        aio_module.aio_handle(engine=name)
    assert name in str(exc.value) and reason in str(exc.value)


def test_unknown_engine_is_value_error(aio_module: ModuleType) -> None:
    """An engine name the library does not know is a ValueError."""
    with pytest.raises(ValueError):
        aio_module.aio_handle(engine="nonesuch")


def test_fault_engine_requires_rules(aio_module: ModuleType) -> None:
    """The test-only fault engine refuses to start without DEEPNVME_FAULT."""
    with pytest.raises(RuntimeError):
        aio_module.aio_handle(engine="fault")


def test_env_selects_default_engine(available_engines: list[str], tmp_path: Path) -> None:
    """DEEPNVME_ENGINE sets the engine of handles built with engine='auto' (fresh process each)."""
    code = (
        "from op_builder import AsyncIOBuilder\n"
        "m = AsyncIOBuilder().load()\n"
        "print(m.aio_handle().get_engine(), m.aio_handle(engine='auto').get_engine())\n"
    )
    for name in available_engines:
        env = dict(os.environ, DEEPNVME_ENGINE=name, PYTHONPATH=str(REPO_ROOT))
        out = subprocess.run([sys.executable, "-c", code], check=False, env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [name, name]


def test_locked_tensor_shape_and_alignment(aio_module: ModuleType) -> None:
    """new_cpu_locked_tensor gives a 1-D page-aligned CPU tensor of the example's dtype."""
    h = aio_module.aio_handle()
    page = os.sysconf("SC_PAGE_SIZE")
    for dtype in (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool):
        t = h.new_cpu_locked_tensor(1000, torch.empty(3, 4, dtype=dtype))
        assert t.dtype == dtype and t.dim() == 1 and t.numel() == 1000 and t.device.type == "cpu"
        assert t.data_ptr() % page == 0
        assert h.is_pinned(t)
        assert h.free_cpu_locked_tensor(t) is True


def test_env_engine_errors(aio_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad DEEPNVME_ENGINE is reported like a bad engine= argument; an explicit engine= overrides it."""
    monkeypatch.setenv("DEEPNVME_ENGINE", "nonesuch")
    with pytest.raises(ValueError):
        aio_module.aio_handle()
    assert aio_module.aio_handle(engine="posix").get_engine() == "posix"
    monkeypatch.setenv("DEEPNVME_ENGINE", "posix")
    assert aio_module.aio_handle().get_engine() == "posix"
    assert aio_module.aio_handle(engine=aio_module.available_engines()[0]).get_engine() == \
        aio_module.available_engines()[0]
