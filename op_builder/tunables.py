"""Performance tunables of the I/O engine, in one place: each a documented default and an env variable.

The C++ core reads each variable once per process, on the first handle (``csrc/aio/tunables.*``); its
built-in defaults are the values below, passed to the compiler as ``-DDEEPNVME_DEFAULT_<NAME>``. Read
them from Python with :mod:`deepnvme.defaults`. A value is a positive integer of bytes or a count, with
an optional K/M/G suffix (1024-based) for byte sizes; anything else fails the next handle with a
ValueError naming the variable. Each value has an upper bound too, and the staging pool as a whole (buffers
times bytes per buffer) at most :data:`STAGING_POOL_MAX_BYTES`: a size that wraps around 64 bits, or a pool
that cannot be mapped, fails up front instead of leaving staged transfers waiting for buffers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["HANDLE_LIMITS", "STAGING_POOL_MAX_BYTES", "TUNABLES", "Tunable", "by_name", "defines", "parse",
           "value"]


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
    #: the largest value accepted (keeps sizes far from wrapping around 64 bits)
    maximum: int = 64 << 30

    @property
    def define(self) -> str:
        """The compiler define that carries the default into the C++ core."""
        return f"DEEPNVME_DEFAULT_{self.name.upper()}"


TUNABLES: tuple[Tunable, ...] = (
    Tunable("staging_buffer_bytes", "DEEPNVME_STAGING_BUFFER_BYTES", 1 << 20,
            "Size of each buffer of the process-wide staging (bounce) pool, used for memory that cannot go "
            "to O_DIRECT as it is (unaligned host memory, GPU memory). Large enough that one buffer is a "
            "full-speed block; small enough that many fit in RLIMIT_MEMLOCK. It is also the shortest staged "
            "operation: smaller blocks of staged memory are moved a buffer's worth at a time.",
            multiple_of=4096, maximum=1 << 30),
    Tunable("staging_buffers", "DEEPNVME_STAGING_BUFFERS", 128,
            "Buffers in the staging pool, shared by every handle of the process (allocated and locked on "
            "the first staged transfer). A staged operation takes a run of contiguous buffers as long as "
            "the handle's block; one worker may hold at most half of them, so that it cannot starve the "
            "others. The default holds two workers' worker_staging_bytes.",
            minimum=2, maximum=65536),
    Tunable("worker_staging_bytes", "DEEPNVME_WORKER_STAGING_BYTES", 64 << 20,
            "Staged bytes one worker thread keeps in flight, and the longest staged operation. Enough to "
            "keep 8 MiB blocks several deep; bench/plain_vs_locked.py measures plain against locked tensors "
            "for a chosen value."),
    Tunable("min_slice_bytes", "DEEPNVME_MIN_SLICE_BYTES", 256 << 10,
            "Smallest part of one request handed to another worker thread: below it, the hand-off costs "
            "more than the second thread brings."),
    Tunable("gds_min_chunk_bytes", "DEEPNVME_GDS_MIN_CHUNK_BYTES", 64 << 10,
            "Smallest part of one gds_handle request given to another thread.", multiple_of=4096,
            maximum=1 << 30),
    Tunable("gds_max_call_bytes", "DEEPNVME_GDS_MAX_CALL_BYTES", 1 << 30,
            "Most bytes one cuFileRead/cuFileWrite call moves; longer requests loop. cuFile returns an "
            "ssize_t and the kernel moves under 2 GiB per POSIX call in compatibility mode.",
            multiple_of=4096, maximum=(2 << 30) - 4096),
)

#: The staging pool is one mapping of staging_buffers x staging_buffer_bytes: at most this many bytes
#: (mirrored by DNV_STAGING_POOL_MAX_BYTES in csrc/aio/tunables.h).
STAGING_POOL_MAX_BYTES = 64 << 30

#: The largest value each integer aio_handle setting may take, and why: the one limit per setting. The C++
#: binding checks the handle's arguments against these (passed as ``-DDEEPNVME_MAX_<NAME>``, read by
#: csrc/aio/handle_config.h's make_config), and deepnvme._core.handles.check_settings checks the library's
#: and the tuned-settings files' against the same table, before any handle is made.
HANDLE_LIMITS: dict[str, tuple[int, str]] = {
    # DeepSpeed's callers pass a tensor's size as its block, so any block a tensor could have is taken; the
    # handle itself cuts no request into parts above 1 GiB (engine.h kMaxOpBytes). The bound keeps size
    # arithmetic far from wrapping around 64 bits.
    "block_size": (1 << 62, "any tensor's size; parts above 1 GiB are cut by the handle"),
    # io_uring rings hold at most 32768 entries (IORING_MAX_ENTRIES), and libaio's contexts share the
    # system-wide fs.aio-max-nr (65536 by default) with every other process.
    "queue_depth": (32768, "io_uring's largest ring (IORING_MAX_ENTRIES)"),
    # Each is a worker thread with its own engine context.
    "intra_op_parallelism": (1024, "one worker thread and engine context each"),
}

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# ASCII digits and blanks only, as the C++ core reads them (\d and \s would take other digits and newlines).
_BLANKS = " \t"
_PATTERN = re.compile(r"[ \t]*([0-9]{1,15})[ \t]*([KMGkmg]?)[ \t]*")


def by_name(name: str) -> Tunable:
    """The row of one tunable; KeyError naming the known ones."""
    for t in TUNABLES:
        if t.name == name:
            return t
    raise KeyError(f"unknown tunable {name!r} (known: {', '.join(t.name for t in TUNABLES)})")


def parse(tunable: Tunable, text: str) -> int:
    """A variable's text as its value; ValueError naming the variable (the C++ core applies the same rule)."""
    m = _PATTERN.fullmatch(text)
    if not m:
        raise ValueError(f"{tunable.env}={text!r} is not a positive integer (optionally with K, M or G)")
    v = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if v > tunable.maximum:
        raise ValueError(f"{tunable.env}={text!r} must be at most {tunable.maximum}")
    if v < tunable.minimum:
        raise ValueError(f"{tunable.env}={text!r} must be at least {tunable.minimum}")
    if v % tunable.multiple_of:
        raise ValueError(f"{tunable.env}={text!r} must be a multiple of {tunable.multiple_of}")
    return v


def value(name: str) -> int:
    """The value the C++ core will use: ``$<env>`` when set and non-empty, else the default."""
    v = _read(by_name(name))
    if name in ("staging_buffers", "staging_buffer_bytes"):
        count, size = _read(by_name("staging_buffers")), _read(by_name("staging_buffer_bytes"))
        if count * size > STAGING_POOL_MAX_BYTES:
            raise ValueError(f"DEEPNVME_STAGING_BUFFERS x DEEPNVME_STAGING_BUFFER_BYTES ({count} x {size}) "
                             f"must be at most {STAGING_POOL_MAX_BYTES} bytes")
    return v


def _read(t: Tunable) -> int:
    """One variable's value, or its default when unset or blank (spaces and tabs only, as in C++)."""
    text = os.environ.get(t.env, "")
    return parse(t, text) if text.strip(_BLANKS) else t.default


def defines() -> list[str]:
    """``-DDEEPNVME_DEFAULT_<NAME>=<default>`` for every tunable and ``-DDEEPNVME_MAX_<SETTING>=<limit>`` for
    every handle setting's limit (the async_io and gds builds)."""
    return [*(f"-D{t.define}={t.default}" for t in TUNABLES),
            *(f"-DDEEPNVME_MAX_{name.upper()}={limit}" for name, (limit, _) in HANDLE_LIMITS.items())]
