"""Argument checks with one exception vocabulary, so every public entry point fails the same way.

The rule: a value of the wrong type raises ``TypeError``; a value of the right type that is out of range
raises ``ValueError``. Either message names the argument and shows what was given. ``bool`` is not
accepted where an int is asked for, although Python makes it one: ``True`` as a count is always a slip.
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["check_int", "check_path", "check_positive_number", "check_type"]


def check_int(name: str, value: Any, minimum: int | None = 1, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) within [minimum, maximum]; ``None`` leaves a side open.

    TypeError names ``name`` when ``value`` is not an int; ValueError when it is outside the range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_path(name: str, value: Any) -> str:
    """Return ``value`` (a str, bytes or os.PathLike, as torch.save and torch.load take) as a str path."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__}")
    return os.fsdecode(os.fspath(value))


def check_positive_number(name: str, value: Any) -> float:
    """Return ``value`` as a float if it is a finite number > 0 (int or float, not bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_type(name: str, value: Any, expected: type | tuple[type, ...]) -> Any:
    """Return ``value`` if it is an instance of ``expected``; TypeError naming ``name`` otherwise."""
    if not isinstance(value, expected):
        names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
        raise TypeError(f"{name} must be a {names}, got {type(value).__name__}")
    return value
