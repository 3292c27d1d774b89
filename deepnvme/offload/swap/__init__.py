"""The swap floor: named units of bytes in files, moved through one budget of locked memory.

- space.py: `SwapSpace` (units in its own swap file or byte ranges of other files), `Unit`, `Lease` (a
  unit's bytes in the pool while held) and `ReadAhead` (reads kept in flight in a given order);
- pool.py: the budgeted pool of locked buffers (`BufferPool`, first fit) and `round_up` to pages;
- queues.py: the read and write queues (`IOQueue`: requests kept in flight on one handle, each completed
  on its own `Ticket`), demand before prefetch (`DEMAND`, `PREFETCH`);
- preflight.py: the checks made before any memory is locked or file written (budget, RLIMIT_MEMLOCK, free
  space, O_DIRECT);
- folders.py: the per-process swap folders, held by a lock and removed when their owner is dead;
- closing.py: `Closing`, the context-manager and finaliser face of what owns files and locked memory.

The floors above (stores, model, experts, train, infer) use the names exported here, never the modules.
"""

from __future__ import annotations

from deepnvme.offload.swap.cgroup import check_memory_room, memory_left, memory_room, return_freed_memory
from deepnvme.offload.swap.closing import Closing
from deepnvme.offload.swap.pool import Buffer, BufferPool, PoolClosedError, round_up
from deepnvme.offload.swap.preflight import budget_arg, directory_arg
from deepnvme.offload.swap.queues import DEMAND, PREFETCH, Ticket
from deepnvme.offload.swap.space import MAX_REQUESTS_IN_FLIGHT, SWAP_FILE, Lease, ReadAhead, SwapSpace, Unit

__all__ = ["DEMAND", "MAX_REQUESTS_IN_FLIGHT", "PREFETCH", "SWAP_FILE", "Buffer", "BufferPool", "Closing",
           "Lease", "PoolClosedError", "ReadAhead", "SwapSpace", "Ticket", "Unit", "budget_arg",
           "check_memory_room", "directory_arg", "memory_left", "memory_room", "return_freed_memory",
           "round_up"]
