"""The train floor: training with state on the drive, on the swap floor's public names only.

- optimizer.py: `OffloadedOptimizer`, any torch.optim optimizer with its state (and fp32 master weights)
  in a swap space, stepped tile by tile;
- checkpoints.py: its state_dict, load_state_dict, save and load (streamed a piece at a time);
- records.py: one parameter's swapped state and its layout in units (whole, or in chunks);
- probe.py: the state an optimizer will make, learnt ahead by a step on the meta device;
- profile.py: `StepProfile`, what the last step moved and when;
- wrapped.py: how the wrapped optimizer's step is called (without its hooks, per tile; closures refused);
- grouping.py: which optimizers may be stepped tile by tile (element-wise), and the error for one stepped
  whole that does not fit the budget.
"""

from __future__ import annotations

from deepnvme.offload.train.optimizer import OffloadedOptimizer
from deepnvme.offload.train.profile import StepProfile

__all__ = ["OffloadedOptimizer", "StepProfile"]
