"""deepnvme's op-builder framework: builders, capability probes and the ALL_OPS registry.

One job per file: ``builder`` (the OpBuilder contract), ``build_spec`` (one JIT build as plain values),
``jit_cache`` (build root, key, stamp, lock, the build, all from a build spec), ``prebuilt`` (when an
installed op may be used), ``sanitize`` (sanitizer builds, ``DEEPNVME_SANITIZE``), ``diagnose`` (reading
compiler output), ``probe`` (every probe, by name; they live in ``toolchain``, ``linktest``,
``libraries``, ``cuda``, ``fingerprint``), ``capability`` (what a probe found, cached per process),
``engines`` (the async_io engine catalogue), ``tunables`` (the I/O core's performance defaults),
``registry`` (ALL_OPS), ``atomic_file`` (the one atomic-replace recipe: the JIT stamp is written through it,
and the library reaches it through ``deepnvme._core.files``), and one file per op (``async_io``, ``gds``,
``pin_memory``, ``moe``).

Importing this package runs no probe and no compiler and does not import torch; ``ALL_OPS`` is built on
first access.
"""

from __future__ import annotations

from typing import Any

from .async_io import AsyncIOBuilder
from .builder import CUDAOpBuilder, OpBuilder, TorchCPUOpBuilder
from .gds import GDSBuilder
from .moe import MoEBuilder
from .pin_memory import PinMemoryBuilder
from .registry import register

__all__ = ["ALL_OPS", "AsyncIOBuilder", "CUDAOpBuilder", "GDSBuilder", "MoEBuilder", "OpBuilder",
           "PinMemoryBuilder", "TorchCPUOpBuilder", "register"]


def __getattr__(name: str) -> Any:
    # ALL_OPS is lazy: entry-point plugins are imported only when someone asks for the table.
    if name == "ALL_OPS":
        from .registry import all_ops

        return all_ops()
    raise AttributeError(f"module 'op_builder' has no attribute {name!r}")
