"""deepnvme.offload: tensors kept on a drive and moved through a budget of locked memory.

In floors; each imports only the floors below it, through their faces (their __init__), and the whole
package reaches the rest of deepnvme through one door, _doors.py, into deepnvme._core
(tests/layout/test_offload_floors.py holds this):

- swap/ (the bottom): :class:`SwapSpace`, named units of bytes in files, one pool of locked buffers,
  read and write queues with completion per request, prefetch with demand first, pre-flight checks and
  per-process folders; :class:`Unit`, :class:`Lease`, :class:`ReadAhead`.
- stores/: where a model's bytes lie: the store protocol (:class:`Store`, :class:`TensorInfo`,
  :class:`Blob`, :class:`StoreError`), a safetensors checkpoint read in place
  (:class:`SafetensorsStore`), deepnvme's own store (:class:`OwnStore`; reading apart from writing),
  :func:`open_store`.
- model/: which modules are units, under which names a model and a checkpoint know a tensor, a model
  (built on the meta device or not) matched to a store, the placeholders of streamed tensors
  (:class:`StreamedWeightError`).
- experts/: Mixture-of-Experts experts as units of their own, read only when routed to, through
  :class:`ExpertCache` (least-recently-used, in a locked pool of its own, demand before prefetch).
- train/: :class:`OffloadedOptimizer`, any torch.optim optimizer with its state on the drive, and
  :func:`offload_parameters` (:class:`OffloadedParameters`), a model's parameters and gradients on the drive
  between uses: training a model larger than memory (on the lower floors' public names only);
  :func:`offload_shards` (:class:`OffloadedShards`), each rank's shards of a model sharded by torch's FSDP2
  on its drive between uses, saved and resumed through torch.distributed.checkpoint by :func:`dcp_save` /
  :func:`dcp_load`.
- infer/: :func:`from_pretrained` (a Hugging Face model folder to a streamed model ready for
  `generate()` in one call), :func:`stream_weights` / :func:`unstream` / :func:`stats` (inference with
  the weights on the drive, each block read in just before it runs), :func:`load_safetensors` (whole
  tensors through the pool), :func:`write_store` (deepnvme's own store from a model or a state dict).

The module paths of before the floors (deepnvme.offload.store, .stream, .optimizer, ...) still import,
with a DeprecationWarning naming the new path (_moved.py).
"""

from __future__ import annotations

from types import ModuleType

from deepnvme.offload import _moved
from deepnvme.offload.experts import ExpertCache
from deepnvme.offload.infer import (
    from_pretrained,
    load_safetensors,
    stats,
    stream_weights,
    unstream,
    write_store,
)
from deepnvme.offload.model import StreamedWeightError
from deepnvme.offload.stores import (
    Blob,
    OwnStore,
    SafetensorsStore,
    Store,
    StoreError,
    TensorInfo,
    open_store,
)
from deepnvme.offload.swap import Lease, ReadAhead, SwapSpace, Unit
from deepnvme.offload.train import (
    OffloadedOptimizer,
    OffloadedParameters,
    OffloadedShards,
    dcp_load,
    dcp_save,
    offload_parameters,
    offload_shards,
)

_moved.install()


def __getattr__(name: str) -> ModuleType:
    """An old module path read as an attribute (`deepnvme.offload.stream.stats`): imported, so it warns."""
    if name in _moved.MOVED:
        return _moved.old_module(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Blob", "ExpertCache", "Lease", "OffloadedOptimizer", "OffloadedParameters", "OffloadedShards",
           "OwnStore", "ReadAhead", "SafetensorsStore", "Store", "StoreError", "StreamedWeightError",
           "SwapSpace", "TensorInfo", "Unit", "dcp_load", "dcp_save", "from_pretrained", "load_safetensors",
           "offload_parameters", "offload_shards", "open_store", "stats", "stream_weights", "unstream",
           "write_store"]
