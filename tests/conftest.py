"""Shared fixtures for the async_io tests: the op loaded once per session, engines, work directories."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
# Helpers and child scripts the tests of every folder import by name (builder_helpers, thread_helpers, ...).
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

from mounts import full_fs, ramfs  # noqa: E402, F401 - mounted file systems, fixtures of several folders

from op_builder.engines import names as _engine_names  # noqa: E402 - after the sys.path line above

# Every real engine the library knows, in its order of preference (from the engine catalogue).
ENGINES = _engine_names()


@pytest.fixture(scope="session")
def aio_module() -> ModuleType:
    """The async_io op, JIT-built at most once per session (TORCH_EXTENSIONS_DIR or torch's default cache)."""
    from op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load()


@pytest.fixture(scope="session")
def pin_module(aio_module: ModuleType) -> ModuleType:
    """The pin_memory op, loaded after async_io (the registry must be shared whatever the order)."""
    from op_builder import PinMemoryBuilder

    return PinMemoryBuilder().load()


@pytest.fixture(scope="session")
def available_engines(aio_module: ModuleType) -> list[str]:
    """Engines usable on this machine, as the library reports them."""
    return list(aio_module.available_engines())


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, aio_module: ModuleType) -> str:
    """Each real engine in turn; skipped with the library's own reason where it is unavailable."""
    name = request.param
    if name not in aio_module.available_engines():
        pytest.skip(f"engine {name} unavailable: {aio_module.engine_status().get(name, 'not reported')}")
    return name


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh directory on the real disk (pytest's basetemp is on ext4 here, not tmpfs)."""
    d = tmp_path / "io"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _no_engine_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """aio tests start without DEEPNVME_ENGINE / DEEPNVME_FAULT so that defaults are the library's own."""
    if request.node.path.name.startswith("test_aio_"):
        monkeypatch.delenv("DEEPNVME_ENGINE", raising=False)
        monkeypatch.delenv("DEEPNVME_FAULT", raising=False)


def pytest_report_header(config: pytest.Config) -> str:
    """Show where JIT builds go, to make rebuilds visible."""
    return f"TORCH_EXTENSIONS_DIR={os.environ.get('TORCH_EXTENSIONS_DIR', '<torch default>')}"
