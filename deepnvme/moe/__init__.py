"""deepnvme.moe: Mixture of Experts (DeepSpeed-compatible); submodules load on first use, so
``import deepnvme.moe`` imports no torch."""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it; each MoE part adds its own lines here.
_LAZY = {
    "assign_slots": "routing",
    "dispatch": "routing",
    "combine": "routing",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first access."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """Show the lazy names too."""
    return sorted(set(globals()) | set(_LAZY))
