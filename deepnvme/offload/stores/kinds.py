"""The table of the stores that exist: `open_store(path)` picks one by what is at `path`.

A store kind is a reader (protocol.py says what every store provides): own_read.py for deepnvme's own
store, safetensors_read.py for a Hugging Face checkpoint read in place.
"""

from __future__ import annotations

import os

from deepnvme.offload.stores.own_format import MANIFEST
from deepnvme.offload.stores.own_read import OwnStore
from deepnvme.offload.stores.protocol import Store
from deepnvme.offload.stores.safetensors_read import SafetensorsStore


def open_store(path: str | os.PathLike) -> Store:
    """The store at `path`: a deepnvme store directory (its manifest), a safetensors file, or a
    directory holding `model.safetensors` or `model.safetensors.index.json`."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
        return OwnStore(path)
    return SafetensorsStore(path)
