"""The engine catalogue: every async_io engine, once, with what building, probing and choosing it needs.

One row per engine, in the order ``engine="auto"`` prefers them. Everything else derives from this table:
the async_io builder's defines and link flags, the library probes' headers and functions, ds_report's
engine line, ds_io's and ds_nvme_tune's ``--engine`` choices, fio's engine in the tuner's comparison, and
the tests' engine matrix. The C++ side lists the same rows in ``csrc/aio/engine_list.h`` (an X-macro the
engine table is built from); a test checks that both lists, and the functions each engine file calls,
agree with this one.

Adding an engine: write ``csrc/aio/engine_<cpp_id>.cpp`` (``make_<cpp_id>_engine`` and ``probe_<cpp_id>``),
add its row here and its line to ``engine_list.h``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUTO", "ENGINES", "Engine", "by_name", "names", "real_engines"]

#: The engine= value that lets the library pick (DEEPNVME_ENGINE, else the first available real engine).
AUTO = "auto"


@dataclass(frozen=True)
class Engine:
    """One async_io engine: its names, its C++ file and, when it needs one, its system library."""

    #: as ``engine=``, ``DEEPNVME_ENGINE`` and ``engine_status()`` spell it
    name: str
    #: the C++ file is ``csrc/aio/engine_<cpp_id>.cpp``, its entry points ``make_<cpp_id>_engine`` and
    #: ``probe_<cpp_id>``
    cpp_id: str
    #: whether ``engine="auto"`` may pick it (the test-only fault engine may not)
    automatic: bool = True
    #: preprocessor switch set to 1 when the library was found; without it the file builds as a stub
    define: str = ""
    #: link name (``-l<library>``) and header; empty when libc is enough
    library: str = ""
    header: str = ""
    #: the library's functions the engine file calls (all of them, and only those: a test parses the file)
    functions: tuple[str, ...] = ()
    #: capability name of the library probe (ds_report's row) and of a run-time probe, if the kernel or a
    #: container may forbid the engine although it builds
    probe: str = ""
    runtime_probe: str = ""
    #: distribution packages: Debian development package first, then run-time ones (for versions), then
    #: the Fedora name used in the fix text
    packages: tuple[str, ...] = ()
    fedora_package: str = ""
    #: fio's --ioengine for the same kind of I/O (ds_nvme_tune's comparison)
    fio: str = "psync"
    #: one line for people (ds_report, --help)
    summary: str = ""

    @property
    def source(self) -> str:
        """The engine's C++ file, relative to the repository (``csrc/aio/engine_<cpp_id>.cpp``)."""
        return f"csrc/aio/engine_{self.cpp_id}.cpp"

    @property
    def needs_library(self) -> bool:
        """Whether the engine is built only when its library is found."""
        return bool(self.library)


ENGINES: tuple[Engine, ...] = (
    Engine("io_uring", "uring", define="DEEPNVME_WITH_URING", library="uring", header="liburing.h",
           functions=("io_uring_cq_advance", "io_uring_cqe_get_data", "io_uring_get_sqe",
                      "io_uring_peek_batch_cqe", "io_uring_prep_read", "io_uring_prep_read_fixed",
                      "io_uring_prep_write", "io_uring_prep_write_fixed", "io_uring_queue_exit",
                      "io_uring_queue_init", "io_uring_register_buffers", "io_uring_sqe_set_data",
                      "io_uring_submit", "io_uring_submit_and_wait"),
           probe="liburing", runtime_probe="io_uring_runtime", packages=("liburing-dev", "liburing2"),
           fedora_package="liburing-devel", fio="io_uring", summary="io_uring (liburing)"),
    Engine("libaio", "libaio", define="DEEPNVME_WITH_LIBAIO", library="aio", header="libaio.h",
           functions=("io_destroy", "io_getevents", "io_prep_pread", "io_prep_pwrite", "io_setup",
                      "io_submit"),
           probe="libaio", packages=("libaio-dev", "libaio1t64", "libaio1"), fedora_package="libaio-devel",
           fio="libaio", summary="Linux native AIO (libaio)"),
    Engine("posix", "posix", fio="psync", summary="posix threads (pread/pwrite on worker threads)"),
    Engine("fault", "fault", automatic=False, summary="test-only fault injection ($DEEPNVME_FAULT)"),
)


def by_name(name: str) -> Engine:
    """The row of one engine; KeyError naming the engine and the known ones."""
    for engine in ENGINES:
        if engine.name == name:
            return engine
    raise KeyError(f"unknown engine {name!r} (known: {', '.join(names())})")


def real_engines() -> tuple[Engine, ...]:
    """The engines ``auto`` may pick (real I/O), in its order of preference."""
    return tuple(e for e in ENGINES if e.automatic)


def names(automatic_only: bool = True) -> tuple[str, ...]:
    """Engine names in preference order; ``automatic_only=False`` adds the test-only ones."""
    return tuple(e.name for e in ENGINES if e.automatic or not automatic_only)
