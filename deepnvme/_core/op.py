"""The one door to the compiled async_io op: every library module that needs it comes through here.

It is reached straight from ``op_builder`` (never back up through the ``deepnvme`` package face), and the
builder keeps the loaded module per process, so the op is built or imported once however often it is asked
for.
"""

from __future__ import annotations

from deepnvme._core.aio_types import AioModule

__all__ = ["aio_module"]


def aio_module() -> AioModule:
    """The async_io op's module (prebuilt, cached JIT build, or built now on first use)."""
    from op_builder.async_io import AsyncIOBuilder

    return AsyncIOBuilder().load()  # type: ignore[return-value]
