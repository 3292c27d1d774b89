"""The table of the stores that exist: `open_store(path)` picks one by what is at `path`.

A store kind is one file (store.py says what every store provides): ownstore.py for deepnvme's own
store, safetensors_store.py for a Hugging Face checkpoint read in place.
"""

from __future__ import annotations

import os

from deepnvme.offload.ownstore import MANIFEST, OwnStore
from deepnvme.offload.safetensors_store import SafetensorsStore
from deepnvme.offload.store import Store


def open_store(path: str | os.PathLike) -> Store:
    """The store at `path`: a deepnvme store directory (its manifest), a safetensors file, or a
    directory holding `model.safetensors` or `model.safetensors.index.json`."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
        return OwnStore(path)
    return SafetensorsStore(path)
