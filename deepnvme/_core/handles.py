"""aio_handle settings, checked once, and the handles the library makes from them.

Every handle the library or a tool makes without being given one comes from :func:`new_handle`,
:func:`default_handle` or :func:`checkpoint_handle`, with :data:`RECOMMENDED` (or, for checkpoints,
:data:`CHECKPOINT`) for whatever the caller does not set: fast for plain and locked tensors alike, with no
tuning for a drive. :func:`check_settings` is the one validation of a caller's settings, so a bad value
fails where it is given (a constructor, a command line, a tuned-settings file), not later when the first
handle is made in the middle of a save.

Checkpoints move a few large sequential transfers, so their handles default to :data:`CHECKPOINT`, and a
drive's tuned settings (``ds_nvme_tune``'s ``best_config.json``) can replace that default: for the
checkpoints of one directory, as a file named :data:`TUNED_FILE` in it (or in the directory above it), and
for a whole process, named by the environment variable :data:`TUNED_ENV`. :func:`checkpoint_settings` says
which applies.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from deepnvme._core.aio_types import AioHandle
from deepnvme._core.checks import check_int, check_type
from deepnvme._core.op import aio_module
from op_builder.tunables import HANDLE_LIMITS

__all__ = ["CHECKPOINT", "LIMITS", "RECOMMENDED", "SWAP", "TUNED_ENV", "TUNED_FILE", "check_settings",
           "checkpoint_handle", "checkpoint_settings", "default_handle", "new_handle", "read_tuned"]

# One thread per slice of a request with two slices in flight keeps a drive busy from a plain tensor too;
# 32 blocks of 1 MiB in flight per thread is past where a drive's throughput stops growing.
RECOMMENDED: dict[str, Any] = {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False,
                               "overlap_events": True, "intra_op_parallelism": 2}

# A checkpoint is a few large sequential transfers: 8 MiB blocks cut them into fewer requests, each as
# large as a drive takes in one command, and 32 of them per thread keep it busy (bench/ckpt_bench.py's grid
# measures the alternatives beside it).
CHECKPOINT: dict[str, Any] = {**RECOMMENDED, "block_size": 8 << 20}

# An offloaded optimizer's swap moves tiles of tens of MiB from and into locked memory, both ways at once:
# blocks as large as a drive usually takes in one command (a common max_sectors_kb) halve the commands
# per byte against 1 MiB without leaving fewer requests in flight than the tiles already give, and
# bench/offload_bench.py's raw bound chooses them too.
SWAP: dict[str, Any] = {**RECOMMENDED, "block_size": 4 << 20}

# A directory's tuned checkpoint settings: this file in it (or in the directory above it).
TUNED_FILE = "deepnvme-handle.json"
# The process's tuned checkpoint settings: the path of such a file.
TUNED_ENV = "DEEPNVME_HANDLE_CONFIG"

# The largest value each integer setting may take, and why: op_builder's one table, which the C++ binding is
# built with too (csrc/aio/handle_config.h), so a value passes here exactly when it passes there.
LIMITS: dict[str, tuple[int, str]] = HANDLE_LIMITS
_FLAGS = ("single_submit", "overlap_events")


def check_settings(given: Mapping[str, Any], base: Mapping[str, Any] = RECOMMENDED) -> dict[str, Any]:
    """The handle settings ``given`` (None values left out) over ``base``, each checked.

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
    return {**base, **chosen}


def new_handle(**settings: Any) -> AioHandle:
    """A new aio_handle with ``settings`` over :data:`RECOMMENDED`, checked first."""
    return aio_module().aio_handle(**check_settings(settings))


_local = threading.local()


def _thread_handles() -> dict[Any, Any]:
    """This thread's handles (a forked child starts with none: a handle's threads do not survive fork)."""
    handles = getattr(_local, "handles", None)
    if handles is None or _local.pid != os.getpid():
        handles = _local.handles = {}
        _local.pid = os.getpid()
    return handles


def default_handle(slot: int = 0) -> AioHandle:
    """This thread's aio_handle number `slot` with :data:`RECOMMENDED`, made on first use (checkpoints use
    :func:`checkpoint_handle` instead; deepnvme.load keeps two of those so that one batch of reads is queued
    while the other's complete).

    One per thread because a handle's wait() completes every request queued on it: two threads sharing one
    would wait for, and receive the errors of, each other's requests. A forked child makes its own.
    """
    handles = _thread_handles()
    handle = handles.get(slot)
    if handle is None:
        handle = handles[slot] = aio_module().aio_handle(**RECOMMENDED)
    return handle


def read_tuned(path: str) -> dict[str, Any]:
    """The aio_handle settings in file `path`: ds_nvme_tune's best_config.json (the settings themselves) or
    its --json record (the settings under "config"); ValueError naming the file for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON aio_handle settings ({exc})") from exc
    if isinstance(found, dict) and isinstance(found.get("config"), dict):
        found = found["config"]
    if not isinstance(found, dict):
        raise ValueError(f"{path}: expected a JSON object of aio_handle settings, got {type(found).__name__}")
    try:
        return check_settings(found, CHECKPOINT)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def checkpoint_settings(directory: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], str]:
    """The aio_handle settings for checkpoints in `directory`, and where they come from.

    First :data:`TUNED_FILE` in `directory`, then in its parent; then the file the environment variable
    :data:`TUNED_ENV` names; else :data:`CHECKPOINT` ("built-in"). Settings a file leaves out are
    CHECKPOINT's. A file that exists but does not hold valid settings raises ValueError naming it (a typo
    should not silently cost the tuned speed), as does a TUNED_ENV naming no file.
    """
    if directory is not None:
        here = os.path.abspath(os.fspath(directory))
        for place in (here, os.path.dirname(here)):
            candidate = os.path.join(place, TUNED_FILE)
            if os.path.isfile(candidate):
                return read_tuned(candidate), candidate
    named = os.environ.get(TUNED_ENV)
    if named:
        if not os.path.isfile(named):
            raise ValueError(f"{TUNED_ENV}={named!r} names no file (ds_nvme_tune's best_config.json is one)")
        return read_tuned(named), named
    return dict(CHECKPOINT), "built-in"


def checkpoint_handle(directory: str | os.PathLike[str] | None = None, slot: int = 0) -> AioHandle:
    """This thread's handle number `slot` for checkpoints in `directory`, with :func:`checkpoint_settings`.

    Made on first use and kept per thread (see :func:`default_handle` for why), one per slot: a checkpoint
    elsewhere with other settings replaces it, so directories tuned differently never pile up handles.
    """
    settings, _ = checkpoint_settings(directory)
    wanted = tuple(sorted(settings.items()))
    handles = _thread_handles()
    kept = handles.get(("checkpoint", slot))
    if kept is None or kept[0] != wanted:
        kept = handles[("checkpoint", slot)] = (wanted, aio_module().aio_handle(**settings))
    return kept[1]
