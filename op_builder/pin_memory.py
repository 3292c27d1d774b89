"""The pin_memory op: page-locked CPU tensors shared with the async_io and gds handles."""

from __future__ import annotations

from .builder import TorchCPUOpBuilder

__all__ = ["PinMemoryBuilder"]


class PinMemoryBuilder(TorchCPUOpBuilder):
    """Builds ``pin_handle`` from the same locked-tensor registry the I/O handles use."""

    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    BUILTIN_SOURCES = True

    def sources(self) -> list[str]:
        return ["csrc/pin/py_pin.cpp", "csrc/aio/pinned.cpp", "csrc/aio/error.cpp"]

    def include_paths(self) -> list[str]:
        return ["csrc/aio"]
