"""Every import deepnvme.offload takes from the rest of deepnvme, in one place.

The package is being reorganised (deepnvme/io.py's internals are moving to deepnvme/_core); when a door
moves, only this file changes.
"""

from __future__ import annotations

from typing import Any

from deepnvme.io import DEFAULT_HANDLE_SETTINGS, PAGE, aligned_buffer  # noqa: F401 - re-exported


def aio_op() -> Any:
    """The compiled async_io op (built once, cached)."""
    from op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load()


def new_handle(**settings: Any) -> Any:
    """A fresh aio_handle with the project's default settings, overridden by `settings`."""
    return aio_op().aio_handle(**{**DEFAULT_HANDLE_SETTINGS, **settings})


def locked_bytes() -> int:
    """Bytes of locked memory registered in this process (every handle's and pin_handle's)."""
    from op_builder import PinMemoryBuilder

    aio_op()  # the registry is shared once async_io is loaded
    return int(PinMemoryBuilder().load().pin_handle().locked_bytes())


def save_streamed(obj: Any, path: Any, payloads: Any) -> None:
    """deepnvme.save of `obj`, each storage's bytes given by `payloads(storage)` (serialization.save)."""
    from deepnvme.serialization import save

    save(obj, path, payloads=payloads)
