"""Performance tunables of the I/O engine, in one place: each a documented default and an env variable.

The C++ core reads each variable once per process, on the first handle (``csrc/aio/tunables.*``); its
built-in defaults are the values below, passed to the compiler as ``-DDEEPNVME_DEFAULT_<NAME>``. Read
them from Python with :mod:`deepnvme.defaults`. A value is a positive integer of bytes or a count, with
an optional K/M/G suffix (1024-based) for byte sizes; anything else fails the next handle with a
ValueError naming the variable.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["TUNABLES", "Tunable", "by_name", "defines", "parse", "value"]


@dataclass(frozen=True)
class Tunable:
    """One setting: its name, environment variable, built-in default, unit rule and why it is that."""

    name: str
    env: str
    default: int
    doc: str
    #: values must be a multiple of this (e.g. 4096 for buffers that O_DIRECT transfers use)
    multiple_of: int = 1
    minimum: int = 1

    @property
    def define(self) -> str:
        """The compiler define that carries the default into the C++ core."""
        return f"DEEPNVME_DEFAULT_{self.name.upper()}"


TUNABLES: tuple[Tunable, ...] = (
    Tunable("staging_buffer_bytes", "DEEPNVME_STAGING_BUFFER_BYTES", 1 << 20,
            "Size of each buffer of the process-wide staging (bounce) pool, used for memory that cannot go "
            "to O_DIRECT as it is (unaligned host memory, GPU memory). Large enough that one buffer is a "
            "full-speed block; small enough that many fit in RLIMIT_MEMLOCK.", multiple_of=4096),
    Tunable("staging_buffers", "DEEPNVME_STAGING_BUFFERS", 64,
            "Buffers in the staging pool, shared by every handle of the process. One worker may hold at "
            "most half of them, so that small staged blocks of one worker cannot starve the others.",
            minimum=2),
    Tunable("worker_staging_bytes", "DEEPNVME_WORKER_STAGING_BYTES", 8 << 20,
            "Staged bytes one worker thread keeps in flight. Beyond what hides the device's latency, more "
            "buffers only spread the copies over memory that has left the cache (bench/plain_vs_locked.py "
            "measures plain against locked tensors for a chosen value)."),
    Tunable("min_slice_bytes", "DEEPNVME_MIN_SLICE_BYTES", 256 << 10,
            "Smallest part of one request handed to another worker thread: below it, the hand-off costs "
            "more than the second thread brings."),
    Tunable("gds_min_chunk_bytes", "DEEPNVME_GDS_MIN_CHUNK_BYTES", 64 << 10,
            "Smallest part of one gds_handle request given to another thread.", multiple_of=4096),
    Tunable("gds_max_call_bytes", "DEEPNVME_GDS_MAX_CALL_BYTES", 1 << 30,
            "Most bytes one cuFileRead/cuFileWrite call moves; longer requests loop. cuFile returns an "
            "ssize_t and the kernel moves under 2 GiB per POSIX call in compatibility mode.",
            multiple_of=4096),
)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_PATTERN = re.compile(r"^\s*(\d{1,15})\s*([KMG]?)\s*$", re.IGNORECASE)


def by_name(name: str) -> Tunable:
    """The row of one tunable; KeyError naming the known ones."""
    for t in TUNABLES:
        if t.name == name:
            return t
    raise KeyError(f"unknown tunable {name!r} (known: {', '.join(t.name for t in TUNABLES)})")


def parse(tunable: Tunable, text: str) -> int:
    """A variable's text as its value; ValueError naming the variable (the C++ core applies the same rule)."""
    m = _PATTERN.match(text)
    if not m:
        raise ValueError(f"{tunable.env}={text!r} is not a positive integer (optionally with K, M or G)")
    v = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if v < tunable.minimum:
        raise ValueError(f"{tunable.env}={text!r} must be at least {tunable.minimum}")
    if v % tunable.multiple_of:
        raise ValueError(f"{tunable.env}={text!r} must be a multiple of {tunable.multiple_of}")
    return v


def value(name: str) -> int:
    """The value the C++ core will use: ``$<env>`` when set and non-empty, else the default."""
    t = by_name(name)
    text = os.environ.get(t.env, "").strip()
    return parse(t, text) if text else t.default


def defines() -> list[str]:
    """``-DDEEPNVME_DEFAULT_<NAME>=<default>`` for every tunable (the async_io and gds builds)."""
    return [f"-D{t.define}={t.default}" for t in TUNABLES]
