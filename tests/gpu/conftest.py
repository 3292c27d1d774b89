"""GPU tests: skipped as a whole, with the reason, where torch has no CUDA device or gds cannot be built."""

from __future__ import annotations

from types import ModuleType

import pytest


def _why_not() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _why_not()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"GPU tests: {why}")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gds_module() -> ModuleType:
    """The gds op, JIT-built once per session; a build failure fails the tests that need it (loudly)."""
    from op_builder import GDSBuilder

    builder = GDSBuilder()
    if not builder.is_compatible(verbose=True):
        pytest.fail("gds is not buildable on this CUDA machine: see the [WARNING] above, or ds_report")
    return builder.load()

