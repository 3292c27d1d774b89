"""Fixtures of the MoE tests: the compiled routing op built before any test spawns ranks."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def routing_op_built() -> None:
    """Build (or find) the compiled routing op here, so spawned ranks only load it from the cache and a
    first-time JIT build never runs under their collective timeouts."""
    from deepnvme.moe.routing import op_available

    op_available()
