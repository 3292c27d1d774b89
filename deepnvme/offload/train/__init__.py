"""The train floor: training with state on the drive, on the swap floor's public names only.

- optimizer.py: `OffloadedOptimizer`, any torch.optim optimizer with its state (and fp32 master weights)
  in a swap space, stepped tile by tile; `StepProfile`, what the last step moved and when;
- grouping.py: which optimizers may be stepped tile by tile (element-wise), and the error for one stepped
  whole that does not fit the budget.
"""

from __future__ import annotations

from deepnvme.offload.train.optimizer import OffloadedOptimizer, StepProfile

__all__ = ["OffloadedOptimizer", "StepProfile"]
