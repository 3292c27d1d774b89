"""Every user knob of deepnvme, read (and where it can be, set) from Python in one place.

Two kinds:

- **The I/O core's performance tunables** (staging pool, slicing, GDS chunks): one getter per setting,
  KvikIO's habit. Each is a documented default with an environment variable of its own. The table
  :data:`op_builder.tunables.TUNABLES` is the one place they are written: each getter's docstring is made
  from its row, and tests hold the README's table to it. The C++ core reads the variables once per
  process, when the first handle is made, so set them before that (e.g. in the shell, or ``os.environ`` at
  the top of a script).
- **aio_handle settings**: the presets the library's own handles use (:func:`handle_presets`), each
  setting's limit (:func:`handle_limits`), and the tuned settings for checkpoints: a
  :data:`HANDLE_CONFIG_FILE` in a checkpoint's directory (:func:`write_handle_config`) or the file the
  environment variable :data:`HANDLE_CONFIG_ENV` names (:func:`set_handle_config`);
  :func:`checkpoint_settings` says which applies to a directory. These are read at each save or load.

    >>> import deepnvme.defaults as d
    >>> d.staging_buffer_bytes()          # the default unless DEEPNVME_STAGING_BUFFER_BYTES says otherwise
    >>> d.describe()["min_slice_bytes"]   # env name, default, current value and why
    >>> d.checkpoint_settings("/mnt/nvme/ckpt")   # ({"block_size": 8388608, ...}, "built-in")

Importing this module does not import torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from deepnvme._core import handles as _handles
from deepnvme._core.files import write_atomically
from op_builder import tunables as _tunables

__all__ = ["HANDLE_CONFIG_ENV", "HANDLE_CONFIG_FILE", "checkpoint_settings", "describe", "gds_max_call_bytes",
           "gds_min_chunk_bytes", "get", "handle_limits", "handle_presets", "min_slice_bytes",
           "set_handle_config", "staging_buffer_bytes", "staging_buffers", "worker_staging_bytes",
           "write_handle_config"]

#: The name of a directory's tuned aio_handle settings for its checkpoints (also looked for one level up).
HANDLE_CONFIG_FILE: str = _handles.TUNED_FILE
#: The environment variable naming the process's tuned aio_handle settings file for checkpoints.
HANDLE_CONFIG_ENV: str = _handles.TUNED_ENV


def get(name: str) -> int:
    """The value of one tunable as the core will use it; ValueError naming the variable when malformed."""
    return _tunables.value(name)


def _size(n: int) -> str:
    """A default as the README's table writes it: 1G, 64M, 256K, or a plain count."""
    for unit, suffix in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _getter(name: str) -> Callable[[], int]:
    """The getter of one tunable; its docstring is made from the table, so it cannot state another figure."""
    row = _tunables.by_name(name)

    def getter() -> int:
        return get(name)

    getter.__name__ = getter.__qualname__ = name
    first = row.doc.split(". ")[0].rstrip(".")
    getter.__doc__ = f"{first}: ``${row.env}``, default {_size(row.default)}."
    return getter


staging_buffer_bytes = _getter("staging_buffer_bytes")
staging_buffers = _getter("staging_buffers")
worker_staging_bytes = _getter("worker_staging_bytes")
min_slice_bytes = _getter("min_slice_bytes")
gds_min_chunk_bytes = _getter("gds_min_chunk_bytes")
gds_max_call_bytes = _getter("gds_max_call_bytes")


def describe() -> dict[str, dict[str, Any]]:
    """Every tunable: its environment variable, default, current value (or the error) and documentation."""
    out: dict[str, dict[str, Any]] = {}
    for t in _tunables.TUNABLES:
        try:
            current: Any = _tunables.value(t.name)
        except ValueError as exc:
            current = f"invalid: {exc}"
        out[t.name] = {"env": t.env, "default": t.default, "value": current, "doc": t.doc}
    return out


def handle_presets() -> dict[str, dict[str, Any]]:
    """The aio_handle settings the library's own handles use (copies: changing them changes nothing).

    ``"recommended"``: every handle the library or a tool makes without being given one (1 MiB blocks,
    queue depth 32, 2 threads); ``"checkpoint"``: save, load and the DCP backend when no tuned settings
    apply (8 MiB blocks); ``"swap"``: an offload swap space's handles (4 MiB blocks). A ``handle_settings``
    argument, or a tuned-settings file, is laid over the matching preset.
    """
    return {"recommended": dict(_handles.RECOMMENDED), "checkpoint": dict(_handles.CHECKPOINT),
            "swap": dict(_handles.SWAP)}


def handle_limits() -> dict[str, int]:
    """The largest value each integer aio_handle setting takes (the smallest is 1); the C++ binding is built
    with the same numbers, so ``aio_handle`` itself refuses a larger one with the same ValueError."""
    return {name: limit for name, (limit, _) in _handles.LIMITS.items()}


def checkpoint_settings(directory: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], str]:
    """The aio_handle settings for checkpoints in ``directory``, and where they come from.

    The first of: :data:`HANDLE_CONFIG_FILE` in ``directory``, then in the directory above it; the file
    ``$DEEPNVME_HANDLE_CONFIG`` (:data:`HANDLE_CONFIG_ENV`) names; the built-in ``"checkpoint"`` preset
    (source ``"built-in"``). Settings a file leaves out are the preset's. A file that exists but does not
    hold valid settings raises ValueError naming it, as does the variable naming no file.
    """
    return _handles.checkpoint_settings(directory)


def set_handle_config(path: str | os.PathLike[str] | None) -> None:
    """Make ``path`` (ds_nvme_tune's ``best_config.json``, or its ``--json`` record) the tuned settings of
    this process's checkpoints, by setting ``$DEEPNVME_HANDLE_CONFIG``; None unsets it.

    The file is checked first: ValueError naming it when it is missing or not valid settings, and the
    variable is then left as it was. Read at each save or load, so it applies from the next one; a
    directory's own :data:`HANDLE_CONFIG_FILE` still wins (it describes the drive the data is on).
    """
    if path is None:
        os.environ.pop(HANDLE_CONFIG_ENV, None)
        return
    named = os.fspath(path)
    if not os.path.isfile(named):
        raise ValueError(f"{named!r} names no file (ds_nvme_tune's best_config.json is one)")
    _handles.read_tuned(named)
    os.environ[HANDLE_CONFIG_ENV] = os.path.abspath(named)


def write_handle_config(directory: str | os.PathLike[str], settings: Mapping[str, Any]) -> str:
    """Write ``settings`` (aio_handle keywords) as ``directory``'s :data:`HANDLE_CONFIG_FILE`, the tuned
    settings of every checkpoint in it and in its subdirectories one level down; returns the file's path.

    Checked before anything is written (TypeError or ValueError naming the setting); settings left out are
    the ``"checkpoint"`` preset's. Replaced atomically, so a save running meanwhile reads the old file or
    the new one.
    """
    checked = _handles.check_settings(settings, _handles.CHECKPOINT)
    given = {k: checked[k] for k in settings if settings[k] is not None}
    path = os.path.join(os.fspath(directory), HANDLE_CONFIG_FILE)
    write_atomically(path, (json.dumps(given, indent=2, sort_keys=True) + "\n").encode())
    return path
