"""The pin_memory op: page-locked CPU tensors shared with the async_io and gds handles."""

from __future__ import annotations

import sys

from . import tunables
from .builder import TorchCPUOpBuilder

__all__ = ["PinMemoryBuilder"]  # noqa: F822 - served by __getattr__ below


class PinMemoryBuilder(TorchCPUOpBuilder):
    """Builds ``pin_handle`` from the same locked-tensor registry the I/O handles use."""

    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    BUILTIN_SOURCES = True

    def sources(self) -> list[str]:
        return ["csrc/pin/py_pin.cpp", "csrc/aio/pinned.cpp", "csrc/aio/error.cpp"]

    def include_paths(self) -> list[str]:
        return ["csrc/aio"]

    def cxx_args(self) -> list[str]:
        # The binding includes the handle's headers, whose defaults and limits come from the tunables' table.
        return [*super().cxx_args(), *tunables.defines()]


# Kept out of the module's namespace so that __getattr__ below decides who gets it.
_PinMemoryBuilder = PinMemoryBuilder
del PinMemoryBuilder


def __getattr__(name: str) -> type:
    """``PinMemoryBuilder`` for every importer but DeepSpeed.

    DeepSpeed's CPU builders try ``from op_builder.pin_memory import PinMemoryBuilder`` (meant for its own
    source tree) before their own module. With deepnvme installed that finds this one, and DeepSpeed's
    async_io library then fails to load for want of its own pin_memory's C++ symbols. Refusing the name to
    code inside ``deepspeed`` sends it to its fallback, its own builder.
    """
    if name == "PinMemoryBuilder":
        importer = str(sys._getframe(1).f_globals.get("__name__", ""))
        if importer == "deepspeed" or importer.startswith("deepspeed."):
            raise AttributeError(f"{__name__}.PinMemoryBuilder is deepnvme's, not DeepSpeed's")
        return _PinMemoryBuilder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, with the builder that __getattr__ serves."""
    return sorted({*globals(), "PinMemoryBuilder"})
