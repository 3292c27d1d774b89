"""Capability: what a probe found, and the per-process cache every probe is memoised in."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["PROBE_ENV", "Capability", "cached_probe", "clear_cache", "env_key"]

F = TypeVar("F", bound=Callable[..., Any])

# Environment variables that change what a probe (or a build) would find.
PROBE_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CONDA_PREFIX", "CPATH",
             "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH")

_caches: list[Any] = []


@dataclass(frozen=True)
class Capability:
    """One thing the machine has or lacks, with what was found, why it is missing and how to fix that."""

    name: str
    ok: bool
    detail: str = ""
    reason: str = ""
    fix: str = ""

    def __bool__(self) -> bool:  # lets callers write `if probe.libaio():`
        return self.ok


def env_key() -> tuple[str | None, ...]:
    """Part of every probe's cache key: a probe must not answer for an environment it did not see."""
    return tuple(os.environ.get(k) for k in PROBE_ENV)


def cached_probe(fn: F) -> F:
    """functools.cache, registered so that :func:`clear_cache` forgets it too."""
    memo = functools.cache(fn)
    _caches.append(memo)
    return memo  # type: ignore[return-value]


def clear_cache() -> None:
    """Forget every cached probe result (tests change CC/CFLAGS between probes)."""
    for memo in _caches:
        memo.cache_clear()
