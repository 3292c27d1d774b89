"""deepnvme.offload: tensors kept on a drive and moved through a budget of locked memory.

- :class:`SwapSpace` (swap.py): the core, named units of bytes in files, one pool of locked buffers
  (pool.py), separate read and write queues with completion per request (queues.py), prefetch with demand
  first, pre-flight checks (preflight.py) and per-process directories (swapdir.py); closing.py is the
  context-manager face they share, _doors.py every import from the rest of deepnvme.
- :class:`OffloadedOptimizer` (optimizer.py): any torch.optim optimizer with its state on the drive.
- :func:`stream_weights` / :func:`unstream` / :func:`stats` (stream.py): inference with the weights on the
  drive, each block read in just before it runs, from a store (store.py, the protocol): a safetensors
  checkpoint read in place (safetensors_store.py) or deepnvme's own
  (ownstore.py, :func:`write_store`), opened by stores.py (the table of store kinds); bulk.py reads whole
  tensors through the pool (:func:`load_safetensors`); model_map.py says which modules are units and
  under which names a checkpoint keeps a tensor. Mixture-of-Experts
  experts are units of their own (expert_sets.py finds and maps them, expert_stream.py runs them), read
  only when routed to, through :class:`ExpertCache` (expert_cache.py: least-recently-used, in a locked
  pool of its own, demand before prefetch).
"""

from __future__ import annotations

from deepnvme.offload.bulk import load_safetensors
from deepnvme.offload.expert_cache import ExpertCache
from deepnvme.offload.optimizer import OffloadedOptimizer
from deepnvme.offload.ownstore import OwnStore, write_store
from deepnvme.offload.placeholder import StreamedWeightError
from deepnvme.offload.safetensors_store import SafetensorsStore
from deepnvme.offload.store import Blob, Store, StoreError, TensorInfo
from deepnvme.offload.stores import open_store
from deepnvme.offload.stream import stats, stream_weights, unstream
from deepnvme.offload.swap import Lease, ReadAhead, SwapSpace, Unit

__all__ = ["Blob", "ExpertCache", "Lease", "OffloadedOptimizer", "OwnStore", "ReadAhead", "SafetensorsStore",
           "Store", "StoreError", "StreamedWeightError", "SwapSpace", "TensorInfo", "Unit",
           "load_safetensors", "open_store", "stats", "stream_weights", "unstream", "write_store"]
