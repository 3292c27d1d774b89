"""The stores floor: where a model's bytes lie on the drive, and nothing about models or memory.

- protocol.py: the store protocol (`Store`, `TensorInfo`, `Blob`, `StoreError`) and what every reader of a
  store uses (runs of neighbouring tensors, CRC checks, views of a blob's bytes, pool bytes of a read);
- safetensors_read.py: a Hugging Face safetensors checkpoint read in place (`SafetensorsStore`);
- own_format.py, own_read.py, own_write.py: deepnvme's own store, its format, reading it (`OwnStore`) and
  writing units of named tensors into it (`write_units`; from a model: deepnvme.offload.write_store);
- kinds.py: the table of store kinds (`open_store`).

Stands on the swap floor (page rounding) and the door only.
"""

from __future__ import annotations

from deepnvme.offload.stores.kinds import open_store
from deepnvme.offload.stores.own_format import MANIFEST
from deepnvme.offload.stores.own_read import OwnStore
from deepnvme.offload.stores.own_write import write_units
from deepnvme.offload.stores.protocol import (
    Blob,
    Store,
    StoreError,
    TensorInfo,
    check,
    check_kind,
    crc_error,
    dtype_kind,
    lease_bytes,
    runs,
    tensor_in,
)
from deepnvme.offload.stores.safetensors_read import SafetensorsStore

__all__ = ["MANIFEST", "Blob", "OwnStore", "SafetensorsStore", "Store", "StoreError", "TensorInfo", "check",
           "check_kind", "crc_error", "dtype_kind", "lease_bytes", "open_store", "runs", "tensor_in",
           "write_units"]
