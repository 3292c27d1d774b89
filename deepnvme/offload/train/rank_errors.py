"""One rank's failure raised on every rank of a job that trains together, instead of leaving the others
waiting in a collective the failed rank never joins.

Where every rank runs the same code in the same order (an offloaded unit's hooks, the optimizer's step,
what dcp_save and dcp_load do between DCP's calls) the work is run under `agree`: each rank runs it,
catching what it raises, then the ranks agree (one all_reduce of a flag; only when a rank failed, an
all_gather_object of what failed) and every rank raises the lowest failed rank's error, naming that rank.
An OSError stays an OSError with its errno and file on every rank.

The training hooks agree on a gloo group of their own over the model's ranks (`group_of`), apart from
the groups FSDP gathers and reduces on: its collectives are issued in an order of FSDP's own, which ours
need not follow, and a CPU flag needs no GPU's backend.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# A gloo group of each set of ranks, made once (every rank of the set makes it, in the same order), with the
# default group it was made in (a group of an earlier process group is not this one's).
_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}
# Set on an error agree() raised, to the number of that agree() call: every rank raises it at once, so an
# agree() begun before it (around a step's closure running the hooks) raises it as it is, without another
# collective. An error agreed on earlier and raised again (kept by a future) is agreed on as any other.
_AGREED = "_deepnvme_agreed"
_calls = [0]  # agree() calls made so far in this process


def group_of(tensor: torch.Tensor) -> Any:
    """The gloo group the ranks of DTensor `tensor`'s mesh agree on (made the first time: collective among
    them), or None when there is no other rank to tell."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = tuple(sorted(int(r) for r in tensor.device_mesh.mesh.flatten().tolist()))  # type: ignore[attr-defined]
    if len(ranks) < 2:
        return None
    made = _GROUPS.get(ranks)
    if made is None or made[0] is not dist.group.WORLD:
        made = _GROUPS[ranks] = (dist.group.WORLD, dist.new_group(list(ranks), backend="gloo",
                                                                  use_local_synchronization=True))
    return made[1]


def world() -> Any:
    """The default group, or None when there is no other rank to tell."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


def agree(run: Callable[[], Any], group: Any) -> Any:
    """Run `run` on this rank and agree with the other ranks of `group` (group_of, world; None: no other
    rank) whether it raised anywhere: if it did, raise the lowest failed rank's error on every rank
    (raise_named); else return what `run` returned. Every rank of the group must call it at the same point.
    A KeyboardInterrupt is told too (the others raise a RuntimeError naming the interrupted rank)."""
    _calls[0] += 1
    began = _calls[0]
    failure: BaseException | None = None
    result = None
    try:
        result = run()
    except BaseException as exc:  # noqa: BLE001 - told to every rank, then raised
        failure = exc
    if group is None or getattr(failure, _AGREED, 0) > began:
        if failure is not None:
            raise failure
        return result
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return result
    told: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, None if failure is None else portable(failure), group=group)
    me = dist.get_rank(group)
    for i, what in enumerate(told):
        if what is not None:
            rank = dist.get_global_rank(group, i)
            raise_named(rank, failure if i == me else rebuilt(what), failure)  # type: ignore[arg-type]
    return result  # not reached: a rank failed


def portable(exc: BaseException) -> tuple[str, int | None, str, Any]:
    """What another rank needs to raise `exc` again: its type's name, errno, message, file."""
    if isinstance(exc, OSError):
        return (type(exc).__name__, exc.errno, exc.strerror or str(exc), exc.filename)
    return (type(exc).__name__, None, str(exc), getattr(exc, "filename", None))


def rebuilt(what: tuple[str, int | None, str, Any]) -> BaseException:
    """Another rank's error from portable(): an OSError with its errno and file, a built-in error of its
    type with its message (a ValueError stays one), else a RuntimeError saying its type and message."""
    kind, errno_, message, filename = what
    if errno_ is not None:
        return OSError(errno_, message, filename)
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # noqa: BLE001 - a built-in that takes other arguments
            pass
    return RuntimeError(f"{kind}: {message}")


def raise_named(rank: int, first: BaseException, cause: BaseException | None) -> None:
    """Raise `first`, rank `rank`'s error: an OSError again with its errno and file, its message saying
    the rank; another error as it is, with a note naming the rank; a KeyboardInterrupt (or any other
    BaseException) as it is."""
    if isinstance(first, OSError) and first.errno is not None:
        named = OSError(first.errno, f"rank {rank}: {first.strerror or first}", first.filename)
        setattr(named, _AGREED, _calls[0])
        raise named from cause
    if isinstance(first, Exception):
        first.add_note(f"(raised on rank {rank})")
    setattr(first, _AGREED, _calls[0])
    raise first from (None if cause is first else cause)


__all__ = ["agree", "group_of", "portable", "raise_named", "rebuilt", "world"]
