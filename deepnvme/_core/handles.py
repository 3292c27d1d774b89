"""aio_handle settings, checked once, and the handles the library makes from them.

Every handle the library or a tool makes without being given one comes from :func:`new_handle` or
:func:`default_handle`, with :data:`RECOMMENDED` for whatever the caller does not set: fast for plain and
locked tensors alike, with no tuning for a drive. :func:`check_settings` is the one validation of a
caller's settings, so a bad value fails where it is given (a constructor, a command line), not later when
the first handle is made in the middle of a save.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.checks import check_int, check_type
from deepnvme._core.op import aio_module

__all__ = ["LIMITS", "RECOMMENDED", "check_settings", "default_handle", "new_handle"]

# One thread per slice of a request with two slices in flight keeps a drive busy from a plain tensor too;
# 32 blocks of 1 MiB in flight per thread is past where a drive's throughput stops growing.
RECOMMENDED: dict[str, Any] = {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False,
                               "overlap_events": True, "intra_op_parallelism": 2}

# The largest value each integer setting may take, and why; checked before any handle is made.
LIMITS: dict[str, tuple[int, str]] = {
    # The handle cuts no request into parts larger than 1 GiB; a larger block only wastes staging.
    "block_size": (1 << 30, "the largest request part the handle issues"),
    # io_uring rings hold at most 32768 entries (IORING_MAX_ENTRIES), and libaio's contexts share the
    # system-wide fs.aio-max-nr (65536 by default) with every other process.
    "queue_depth": (32768, "io_uring's largest ring (IORING_MAX_ENTRIES)"),
    # Each is a worker thread with its own engine context.
    "intra_op_parallelism": (1024, "one worker thread and engine context each"),
}
_FLAGS = ("single_submit", "overlap_events")


def check_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """The handle settings ``given`` (None values left out) over :data:`RECOMMENDED`, each checked.

    TypeError for a value of the wrong type, ValueError for an integer outside [1, its limit] or an
    unknown name; each message names the setting.
    """
    chosen = {k: v for k, v in given.items() if v is not None}
    for name, value in chosen.items():
        if name in LIMITS:
            check_int(name, value, 1, LIMITS[name][0])
        elif name in _FLAGS:
            check_type(name, value, bool)
        elif name == "engine":
            check_type(name, value, str)
        else:
            known = ", ".join([*LIMITS, *_FLAGS, "engine"])
            raise ValueError(f"{name} is not an aio_handle setting (known: {known})")
    return {**RECOMMENDED, **chosen}


def new_handle(**settings: Any) -> AioHandle:
    """A new aio_handle with ``settings`` over :data:`RECOMMENDED`, checked first."""
    return aio_module().aio_handle(**check_settings(settings))


_local = threading.local()


def default_handle(slot: int = 0) -> AioHandle:
    """This thread's aio_handle number `slot` with :data:`RECOMMENDED`, made on first use. load keeps a
    second one (slot 1) so that one batch of reads is queued while the other's complete.

    One per thread because a handle's wait() completes every request queued on it: two threads sharing one
    would wait for, and receive the errors of, each other's requests. A forked child makes its own.
    """
    handles = getattr(_local, "handles", None)
    if handles is None or _local.pid != os.getpid():
        handles = _local.handles = {}
        _local.pid = os.getpid()
    handle = handles.get(slot)
    if handle is None:
        handle = handles[slot] = aio_module().aio_handle(**RECOMMENDED)
    return handle
