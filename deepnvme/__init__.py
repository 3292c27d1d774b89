"""deepnvme: tensor<->file I/O for PyTorch; re-exports the op builders and save/load, importing no torch."""

from __future__ import annotations

from typing import Any

from deepnvme._version import __version__

# Resolved from op_builder on first access, so `import deepnvme` stays free of torch, probes and compilers.
_FROM_OP_BUILDER = ("AsyncIOBuilder", "GDSBuilder", "MoEBuilder", "PinMemoryBuilder", "OpBuilder", "ALL_OPS",
                    "register")
# Checkpoints in torch's format (deepnvme.serialization), imported on first access for the same reason.
_FROM_SERIALIZATION = ("save", "load", "CheckpointFormatError")

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CheckpointFormatError",
    "GDSBuilder",
    "MoEBuilder",
    "OpBuilder",
    "PinMemoryBuilder",
    "__version__",
    "load",
    "register",
    "save",
]


def __getattr__(name: str) -> Any:
    """Fetch a name from op_builder on demand; ALL_OPS is looked up anew since plugins may register."""
    if name in _FROM_OP_BUILDER:
        import op_builder

        return getattr(op_builder, name)
    if name in _FROM_SERIALIZATION:
        from deepnvme import serialization

        return getattr(serialization, name)
    raise AttributeError(f"module 'deepnvme' has no attribute {name!r}")


def __dir__() -> list[str]:
    """List the lazy names too, so completion and dir() show the whole public face."""
    return sorted(set(globals()) | set(_FROM_OP_BUILDER) | set(_FROM_SERIALIZATION))
