"""CRC-32 as zip archives use it (zlib's), at the fastest speed this machine offers.

zlib's own crc32, on one core, is slower than a checkpoint's disk; zlib-ng (the `zlib-ng` package)
computes the identical value several times faster (README, "Save and load", has the figure). Both release
the GIL on large buffers, so a worker thread can check or compute CRCs while the handle moves other bytes.
zlib-ng is a dependency, but a missing or broken install falls back to zlib: same values, only slower.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["IMPLEMENTATION", "crc32"]


def _pick() -> tuple[Callable[..., int], str]:
    try:
        from zlib_ng import zlib_ng
    except ImportError:
        return zlib.crc32, "zlib"
    return zlib_ng.crc32, "zlib-ng"


_crc32, IMPLEMENTATION = _pick()


def crc32(data: Any, value: int = 0) -> int:
    """zlib.crc32(data, value): the CRC-32 of a bytes-like object, continuing from `value`."""
    return _crc32(data, value)
