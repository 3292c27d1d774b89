"""deepnvme's performance tunables, read from Python: one getter per setting, KvikIO's habit.

Each setting is a documented default with an environment variable of its own (the table is
:data:`op_builder.tunables.TUNABLES`). The C++ core reads the variables once per process, when the first
handle is made, so set them before that (e.g. in the shell, or ``os.environ`` at the top of a script).

    >>> import deepnvme.defaults as d
    >>> d.staging_buffer_bytes()          # 1048576 unless DEEPNVME_STAGING_BUFFER_BYTES says otherwise
    >>> d.describe()["min_slice_bytes"]   # env name, default, current value and why

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

from op_builder import tunables as _tunables

__all__ = ["describe", "gds_max_call_bytes", "gds_min_chunk_bytes", "get", "min_slice_bytes",
           "staging_buffer_bytes", "staging_buffers", "worker_staging_bytes"]


def get(name: str) -> int:
    """The value of one tunable as the core will use it; ValueError naming the variable when malformed."""
    return _tunables.value(name)


def staging_buffer_bytes() -> int:
    """Bytes per staging (bounce) buffer: ``$DEEPNVME_STAGING_BUFFER_BYTES``, default 1 MiB."""
    return get("staging_buffer_bytes")


def staging_buffers() -> int:
    """Buffers in the process-wide staging pool: ``$DEEPNVME_STAGING_BUFFERS``, default 64."""
    return get("staging_buffers")


def worker_staging_bytes() -> int:
    """Staged bytes one worker keeps in flight: ``$DEEPNVME_WORKER_STAGING_BYTES``, default 8 MiB."""
    return get("worker_staging_bytes")


def min_slice_bytes() -> int:
    """Smallest part of a request given to another worker: ``$DEEPNVME_MIN_SLICE_BYTES``, default 256 KiB."""
    return get("min_slice_bytes")


def gds_min_chunk_bytes() -> int:
    """Smallest gds request part per thread: ``$DEEPNVME_GDS_MIN_CHUNK_BYTES``, default 64 KiB."""
    return get("gds_min_chunk_bytes")


def gds_max_call_bytes() -> int:
    """Most bytes per cuFile call: ``$DEEPNVME_GDS_MAX_CALL_BYTES``, default 1 GiB."""
    return get("gds_max_call_bytes")


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
