"""Byte sizes as the tools take and print them: 4K, 1M, 400M, 1G (1024-based, as DeepSpeed's ds_io)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse '64K', '1M', '1.5G', '4096' into bytes; ValueError naming the text when it is not a size."""
    if isinstance(text, int):
        value = text
    else:
        match = _PATTERN.match(str(text))
        if not match:
            raise ValueError(f"{text!r} is not a size (use bytes or a K/M/G suffix, e.g. 4K, 1M, 1G)")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def format_size(n: int) -> str:
    """Print a byte count in the largest exact binary unit, e.g. 1048576 -> '1M', 1536 -> '1536'."""
    for suffix in ("T", "G", "M", "K"):
        unit = _UNITS[suffix]
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)
