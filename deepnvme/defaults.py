"""deepnvme's performance tunables, read from Python: one getter per setting, KvikIO's habit.

Each setting is a documented default with an environment variable of its own. The table
:data:`op_builder.tunables.TUNABLES` is the one place they are written: each getter's docstring is made from
its row, and tests hold the README's table to it. The C++ core reads the variables once per process, when
the first handle is made, so set them before that (e.g. in the shell, or ``os.environ`` at the top of a
script).

    >>> import deepnvme.defaults as d
    >>> d.staging_buffer_bytes()          # the default unless DEEPNVME_STAGING_BUFFER_BYTES says otherwise
    >>> d.describe()["min_slice_bytes"]   # env name, default, current value and why

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from op_builder import tunables as _tunables

__all__ = ["describe", "gds_max_call_bytes", "gds_min_chunk_bytes", "get", "min_slice_bytes",
           "staging_buffer_bytes", "staging_buffers", "worker_staging_bytes"]


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
