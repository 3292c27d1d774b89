"""The model floor: a model seen as units and named tensors, and matched to a store.

- units.py: which modules are units (`unit_modules`, `unit_names`);
- names.py: under which names a tensor is known, in the model (`tensor_slots`, `tensor_aliases`) and in a
  checkpoint (`checkpoint_names`, `conversions`, `plain_pattern`, `find_tensor`);
- matching.py: a model (built on the meta device or not) matched to a store: each tensor's `Slot` in its
  unit or a `Resident` (`match_store`);
- placeholder.py: what a streamed tensor is between forwards (`Placeholder`, `StreamedWeightError`).

Stands on the stores floor (TensorInfo, StoreError) and nothing above it.
"""

from __future__ import annotations

from deepnvme.offload.model.matching import Resident, Slot, match_store
from deepnvme.offload.model.names import (
    checkpoint_names,
    conversions,
    find_tensor,
    plain_pattern,
    tensor_aliases,
    tensor_slots,
)
from deepnvme.offload.model.placeholder import Placeholder, StreamedWeightError
from deepnvme.offload.model.units import row_readable, table_units, unit_modules, unit_names

__all__ = ["Placeholder", "Resident", "Slot", "StreamedWeightError", "checkpoint_names", "conversions",
           "find_tensor", "match_store", "plain_pattern", "row_readable", "table_units", "tensor_aliases",
           "tensor_slots", "unit_modules", "unit_names"]
