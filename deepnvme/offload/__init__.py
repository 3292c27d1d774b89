"""deepnvme.offload: tensors kept on a drive and moved through a budget of locked memory.

- :class:`SwapSpace` (swap.py): the core, named units of bytes in files, one pool of locked buffers
  (pool.py), separate read and write queues with completion per request (queues.py), prefetch with demand
  first, pre-flight checks (preflight.py) and per-process directories (swapdir.py); closing.py is the
  context-manager face they share, _doors.py every import from the rest of deepnvme.
- :class:`OffloadedOptimizer` (optimizer.py): any torch.optim optimizer with its state on the drive.
"""

from __future__ import annotations

from deepnvme.offload.optimizer import OffloadedOptimizer
from deepnvme.offload.swap import Lease, ReadAhead, SwapSpace, Unit

__all__ = ["Lease", "OffloadedOptimizer", "ReadAhead", "SwapSpace", "Unit"]
