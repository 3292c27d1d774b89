"""deepnvme: tensor<->file I/O for PyTorch; re-exports the op builders and save/load without importing torch.

Where things are:
- the library's public modules: the op builders (re-exported from ``op_builder``, looked up on first use),
  :mod:`.serialization` (``save``/``load`` in torch's format; a package, one module per job),
  :mod:`.checkpoint` (the torch.distributed.checkpoint backend: writer, reader, metadata), :mod:`.io`
  (DeepSpeed's FastFileWriter), :mod:`.offload` (tensors on a drive through a budget of locked memory: the
  swap space, the optimizer, weight streaming, expert caches), :mod:`.moe` (Mixture of Experts; its training
  recipe in :mod:`.moe.recipe`, which the library never imports), :mod:`.defaults` (performance tunables)
  and :mod:`.filesystem` (fsync by name, the mount of a path; ``deepnvme.files`` is its deprecated name).
- the private core: :mod:`deepnvme._core` (the one door to the compiled ops, handle settings, aligned
  memory, the O_DIRECT writer, file opening and atomic replace, the zip layout, CRC-32, argument checks),
  which the public modules stand on; not public API. Doors point one way: tools -> library modules ->
  ``_core`` -> ``op_builder`` (a library module reaches ``op_builder`` only through ``_core``, this face's
  lazy builders and :mod:`.defaults` excepted).
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
