"""The train floor: training with parameters, gradients and optimizer state on the drive, on the swap
floor's public names only.

- optimizer.py: `OffloadedOptimizer`, any torch.optim optimizer with its state (and fp32 master weights)
  in a swap space, stepped tile by tile;
- checkpoints.py: its state_dict, load_state_dict, save and load (streamed a piece at a time);
- records.py: one parameter's swapped state and its layout in units (whole, or in chunks);
- probe.py: the state an optimizer will make, learnt ahead by a step on the meta device;
- profile.py: `StepProfile`, what the last step moved and when;
- wrapped.py: how the wrapped optimizer's step is called (without its hooks, per tile; closures refused);
- grouping.py: which optimizers may be stepped tile by tile (element-wise), and the error for one stepped
  whole that does not fit the budget;
- params.py: `offload_parameters` / `OffloadedParameters`, a model's parameters and gradients on the drive
  between uses; held.py: one offloaded parameter and unit; unit_hooks.py: the forward and backward hooks
  of a unit; lending.py: the optimizer's step reading offloaded parameters and gradients;
- shards.py: `offload_shards` / `OffloadedShards`, the shards of a model sharded by torch's FSDP2 on the
  drive between uses; shard_parts.py: a unit's shard storages and their place on the drive;
  shard_lending.py: the optimizer's step over them; dtensors.py: DTensor parameters stepped through views
  of their local shards; shard_dcp.py: `dcp_save` / `dcp_load`, them and the optimizer's state through
  torch.distributed.checkpoint, streamed.
"""

from __future__ import annotations

from deepnvme.offload.train.optimizer import OffloadedOptimizer
from deepnvme.offload.train.params import OffloadedParameters, offload_parameters
from deepnvme.offload.train.profile import StepProfile
from deepnvme.offload.train.shard_dcp import dcp_load, dcp_save
from deepnvme.offload.train.shards import OffloadedShards, offload_shards

__all__ = ["OffloadedOptimizer", "OffloadedParameters", "OffloadedShards", "StepProfile",
           "dcp_load", "dcp_save", "offload_parameters", "offload_shards"]
