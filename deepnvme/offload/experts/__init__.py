"""The experts floor: Mixture-of-Experts experts as units of their own, read only when tokens are routed to
them.

- sets.py: where a model's expert sets are and where a store keeps each expert's tensors (`find_expert_sets`,
  `expert_parts`, `expert_unit_names`, `split_fused`);
- cache.py: `ExpertCache`, the experts in a locked pool of their own, least recently used evicted, demand
  before prefetch;
- streamer.py: `ExpertStreamer`, what stream_weights does with a model's expert sets (placeholders, the
  experts' forwards, read-ahead and pre-gating);
- fused.py: running a fused (Hugging Face) experts module on a few of its experts;
- budget.py: the experts' share of the budget and when reading ahead pays (`split_budget`, `FULL_USE`).

Stands on the model, stores and swap floors.
"""

from __future__ import annotations

from deepnvme.offload.experts.budget import FULL_USE, expected_share, split_budget
from deepnvme.offload.experts.cache import ExpertCache
from deepnvme.offload.experts.sets import (
    FUSED,
    MODULES,
    ExpertSet,
    Part,
    expert_parts,
    expert_unit_names,
    find_expert_sets,
    split_fused,
)
from deepnvme.offload.experts.streamer import ExpertStreamer

__all__ = ["FULL_USE", "FUSED", "MODULES", "ExpertCache", "ExpertSet", "ExpertStreamer", "Part",
           "expected_share", "expert_parts", "expert_unit_names", "find_expert_sets", "split_budget",
           "split_fused"]
