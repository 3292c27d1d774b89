"""The one door to the compiled ops: every library module that needs async_io (or pin_memory, or the MoE
routing op) comes here.

It is reached straight from ``op_builder`` (never back up through the ``deepnvme`` package face), and the
builder keeps the loaded module per process, so the op is built or imported once however often it is asked
for.
"""

from __future__ import annotations

from typing import Any

from deepnvme._core.aio_types import AioModule

__all__ = ["aio_module", "moe_module", "pin_memory_module"]


def aio_module() -> AioModule:
    """The async_io op's module (prebuilt, cached JIT build, or built now on first use)."""
    from op_builder.async_io import AsyncIOBuilder

    return AsyncIOBuilder().load()  # type: ignore[return-value]


def pin_memory_module() -> Any:
    """The pin_memory op's module (its pin_handle counts the locked memory every handle registers)."""
    from op_builder.pin_memory import PinMemoryBuilder

    return PinMemoryBuilder().load()


def moe_module() -> Any:
    """The MoE routing op's module (deepnvme.moe.routing keeps whether it loads, and why not)."""
    from op_builder.moe import MoEBuilder

    return MoEBuilder().load(verbose=False)
