"""Capability probes, in one namespace: real compile-and-link (and one compile-and-run) checks.

The probes live in files by job: :mod:`.toolchain` (compilers, ninja, -march), :mod:`.linktest` (the
link test), :mod:`.libraries` (the engines' libraries and the io_uring round trip), :mod:`.cuda` (CUDA
toolkit and cuFile) and :mod:`.fingerprint` (stat-only identities for the JIT stamp). Every probe calls
the compiler directly through ``subprocess``, honours ``CC``, ``CFLAGS``, ``LDFLAGS`` and ``CONDA_PREFIX``,
and is cached per process. Nothing runs at import time and nothing imports torch except :func:`cuda`.
"""

from __future__ import annotations

from .capability import PROBE_ENV, Capability, clear_cache
from .cuda import CUFILE_FUNCTIONS, CufileLocation, cuda, cuda_home, cufile, find_cufile, nvcc_version
from .fingerprint import cpu_fingerprint, state_fingerprint
from .libraries import (
    LIBAIO_FUNCTIONS,
    LIBURING_FUNCTIONS,
    engine_library,
    io_uring_runtime,
    libaio,
    liburing,
)
from .linktest import has_function
from .toolchain import compiler, compiler_argv, native_arch_flags, ninja

__all__ = [
    "CUFILE_FUNCTIONS",
    "LIBAIO_FUNCTIONS",
    "LIBURING_FUNCTIONS",
    "PROBE_ENV",
    "Capability",
    "CufileLocation",
    "clear_cache",
    "compiler",
    "compiler_argv",
    "cpu_fingerprint",
    "cuda",
    "cuda_home",
    "cufile",
    "engine_library",
    "find_cufile",
    "has_function",
    "io_uring_runtime",
    "libaio",
    "liburing",
    "native_arch_flags",
    "ninja",
    "nvcc_version",
    "state_fingerprint",
]
