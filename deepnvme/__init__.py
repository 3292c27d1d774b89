"""deepnvme: tensor<->file I/O for PyTorch; re-exports the op builders and save/load without importing torch.

Where things are:
- the library's public modules: the op builders (re-exported from ``op_builder``), :mod:`.serialization`
  (``save``/``load`` in torch's format), :mod:`.io` (DeepSpeed's FastFileWriter), :mod:`.checkpoint` (the
  torch.distributed.checkpoint backend), :mod:`.defaults` (performance tunables) and :mod:`.moe` (Mixture of
  Experts), over :mod:`.files` (fsync by name, mount of a path) and the CRC of :mod:`.crc`.
- the tools: :mod:`deepnvme.tools` — ds_report, ds_io, ds_nvme_tune, the demo and their helpers, run as
  ``python -m deepnvme.tools.<tool>`` or by their commands. The library never imports from there.
- prebuilt ops (``DS_BUILD_*=1``) are installed as ``deepnvme.ops.<name>_op``; the build makes that folder.
"""

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
