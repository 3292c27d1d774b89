"""The async_io op: tensor<->file I/O engines (posix threads always; libaio and io_uring when found)."""

from __future__ import annotations

from . import probe
from .builder import TorchCPUOpBuilder, csrc_root

__all__ = ["AsyncIOBuilder"]

# Engine files that need a library the probes may not find; every other csrc/aio/*.cpp always builds.
_ENGINES = (("libaio", "engine_libaio.cpp", "-DDEEPNVME_WITH_LIBAIO=1", "-laio"),
            ("liburing", "engine_uring.cpp", "-DDEEPNVME_WITH_URING=1", "-luring"))


class AsyncIOBuilder(TorchCPUOpBuilder):
    """Builds ``aio_handle`` and friends; compatible without libaio/liburing (the posix engine needs none)."""

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"
    BUILTIN_SOURCES = True

    def engines(self) -> dict[str, bool]:
        """Which optional engines this machine can build: {"libaio": bool, "liburing": bool}."""
        probes = {"libaio": probe.libaio, "liburing": probe.liburing}
        return {name: self.capability(name, probes[name]).ok for name, *_ in _ENGINES}

    def sources(self) -> list[str]:
        found = self.engines()
        skip = {fname for name, fname, *_ in _ENGINES if not found[name]}
        names = sorted(p.name for p in (csrc_root() / "aio").glob("*.cpp"))
        return [f"csrc/aio/{n}" for n in names if n not in skip]

    def include_paths(self) -> list[str]:
        return ["csrc/aio"]

    def cxx_args(self) -> list[str]:
        found = self.engines()
        return [*super().cxx_args(), *(define for name, _, define, _ in _ENGINES if found[name])]

    def extra_ldflags(self) -> list[str]:
        found = self.engines()
        return [*super().extra_ldflags(), *(lib for name, _, _, lib in _ENGINES if found[name])]

    def probe_inputs(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return ("libaio.h", "liburing.h"), ("aio", "uring"), ()
