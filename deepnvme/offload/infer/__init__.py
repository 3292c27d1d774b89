"""The infer floor: inference with the weights on the drive.

- weights.py: `stream_weights` (each unit read in just before its forward, through a budget of locked
  memory), `unstream`, `stats`;
- running.py: `Streamer`, one streamed model while it runs (reads, views in place, read-ahead, fork);
- load.py: whole tensors read from a store through the pool (`load_safetensors`, `read_into`,
  `read_store`);
- pretrained.py: `from_pretrained`, a Hugging Face model folder to a streamed model ready for
  `generate()` in one call;
- prepare.py: `write_store`, a model or a state dict written as deepnvme's own store, its units the ones
  streaming reads.

Stands on the experts, model, stores and swap floors.
"""

from __future__ import annotations

from deepnvme.offload.infer.load import load_safetensors, read_into, read_store
from deepnvme.offload.infer.prepare import write_store
from deepnvme.offload.infer.pretrained import from_pretrained
from deepnvme.offload.infer.weights import stats, stream_weights, unstream

__all__ = ["from_pretrained", "load_safetensors", "read_into", "read_store", "stats", "stream_weights",
           "unstream", "write_store"]
