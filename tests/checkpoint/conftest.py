"""Fixtures of the checkpoint tests (deepnvme.save/load, the DCP backend, FastFileWriter)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def handle(aio_module: ModuleType) -> Any:
    """The handle the checkpoint tests pass in: 1 MiB blocks, queue depth 32, two threads."""
    return aio_module.aio_handle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=2)
