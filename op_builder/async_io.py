"""The async_io op: tensor<->file I/O engines (posix threads always; libaio and io_uring when found).

The engine pieces (sources, defines, link flags, probe inputs) are functions of any builder's probes, so
the gds op, which compiles the same engine, derives them from its own probes rather than from another
builder's state.
"""

from __future__ import annotations

from . import engines as catalogue
from . import probe, tunables
from .builder import OpBuilder, TorchCPUOpBuilder, csrc_root

__all__ = ["AsyncIOBuilder", "engine_defines", "engine_ldflags", "engine_probe_inputs", "engine_sources"]

BINDING = "csrc/aio/py_aio.cpp"


def engine_sources(binding: bool = True) -> list[str]:
    """Every csrc/aio file (an engine whose library is missing builds as a stub that says why);
    ``binding=False`` leaves out the async_io Python binding."""
    names = [f"csrc/aio/{p.name}" for p in sorted((csrc_root() / "aio").glob("*.cpp"))]
    return [n for n in names if binding or n != BINDING]


def libraries_found(builder: OpBuilder) -> dict[str, bool]:
    """Engine libraries this machine builds against, by probe name (remembered in the builder's stamp)."""
    return {e.probe: builder.capability(e.probe, lambda e=e: probe.engine_library(e)).ok
            for e in catalogue.ENGINES if e.needs_library}


def _built(builder: OpBuilder) -> list[catalogue.Engine]:
    found = libraries_found(builder)
    return [e for e in catalogue.ENGINES if e.needs_library and found[e.probe]]


def engine_defines(builder: OpBuilder) -> list[str]:
    """The engine switches of the libraries found, and the tunables' defaults."""
    return [*(f"-D{e.define}=1" for e in _built(builder)), *tunables.defines()]


def engine_ldflags(builder: OpBuilder) -> list[str]:
    """``-l<library>`` for each engine library found."""
    return [f"-l{e.library}" for e in _built(builder)]


def engine_probe_inputs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(headers, libraries) whose appearance or change alters the engine's flags."""
    libs = [e for e in catalogue.ENGINES if e.needs_library]
    return tuple(e.header for e in libs), tuple(e.library for e in libs)


class AsyncIOBuilder(TorchCPUOpBuilder):
    """Builds ``aio_handle`` and friends; compatible without libaio/liburing (the posix engine needs none)."""

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"
    BUILTIN_SOURCES = True

    def engines(self) -> dict[str, bool]:
        """Engine libraries this machine builds against, by probe: {"liburing": bool, "libaio": bool}."""
        return libraries_found(self)

    def sources(self) -> list[str]:
        return engine_sources()

    def include_paths(self) -> list[str]:
        return ["csrc/aio"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), *engine_defines(self)]

    def extra_ldflags(self) -> list[str]:
        return [*super().extra_ldflags(), *engine_ldflags(self)]

    def probe_inputs(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return (*engine_probe_inputs(), ())
