"""deepnvme: tensor<->file I/O ops for PyTorch; re-exports the op builders without importing torch."""

from __future__ import annotations

from typing import Any

from deepnvme._version import __version__

# Resolved from op_builder on first access, so `import deepnvme` stays free of torch, probes and compilers.
_FROM_OP_BUILDER = ("AsyncIOBuilder", "GDSBuilder", "MoEBuilder", "PinMemoryBuilder", "OpBuilder", "ALL_OPS",
                    "register")

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "GDSBuilder",
    "MoEBuilder",
    "OpBuilder",
    "PinMemoryBuilder",
    "__version__",
    "register",
]


def __getattr__(name: str) -> Any:
    """Fetch a name from op_builder on demand; ALL_OPS is looked up anew since plugins may register."""
    if name in _FROM_OP_BUILDER:
        import op_builder

        return getattr(op_builder, name)
    raise AttributeError(f"module 'deepnvme' has no attribute {name!r}")


def __dir__() -> list[str]:
    """List the lazy names too, so completion and dir() show the whole public face."""
    return sorted(set(globals()) | set(_FROM_OP_BUILDER))
