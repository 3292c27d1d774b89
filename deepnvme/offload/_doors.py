"""Every import deepnvme.offload takes from the rest of deepnvme, in one place: the private core's page
size, round_up, madvise and locked-memory limit, its handles (the recommended settings, the swap's, and
their check), the O_DIRECT opener (the project's one refusal rule), the owner-process liveness rule, the
compiled ops, CRC-32, the atomic file replacement and the regular-file open, deepnvme.save (its
writing half is in the core for this door's sake), deepnvme.checkpoint's DCP storage writer and
reader (offloaded shards save and resume through them), and deepnvme.moe's grouped expert computation (a
streamed deepnvme.moe layer computes its experts as the layer in memory does)."""

from __future__ import annotations

from typing import Any

from deepnvme._core.crc import crc32  # noqa: F401 - re-exported
from deepnvme._core.direct import open_maybe_direct  # noqa: F401 - re-exported
from deepnvme._core.files import (  # noqa: F401 - re-exported
    atomic_target,
    hold_lock,
    lock_held,
    open_regular,
    owner_alive,
    owner_mark,
    write_atomically,
)
from deepnvme._core.handles import SWAP, check_settings, new_handle  # noqa: F401 - re-exported
from deepnvme._core.memory import PAGE, has_cap_ipc_lock, madvise, memlock_limit, round_up  # noqa: F401
from deepnvme._core.op import aio_module, pin_memory_module  # noqa: F401 - aio_module re-exported
from deepnvme.checkpoint import AioStorageReader, AioStorageWriter  # noqa: F401 - re-exported
from deepnvme.moe.grouped import GroupedExperts, stack_views  # noqa: F401 - re-exported


def locked_bytes() -> int:
    """Bytes of locked memory registered in this process (every handle's and pin_handle's)."""
    aio_module()  # the registry is shared once async_io is loaded
    return int(pin_memory_module().pin_handle().locked_bytes())


def save_streamed(obj: Any, path: Any, payloads: Any) -> None:
    """deepnvme.save of `obj`, each storage's bytes given by `payloads(storage)`."""
    from deepnvme._core.saving import save  # imports torch: only when a save runs

    save(obj, path, payloads=payloads)
