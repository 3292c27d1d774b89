"""Expert-parallel (EP) and expert-data-parallel (EDP) process groups, created for the user.

Rank layout (DeepSpeed's legacy layout, no tensor or pipeline parallelism), world W, expert-parallel size ep:

* default ("E+D"): EP groups are consecutive blocks ``[0..ep-1], [ep..2ep-1], …``; EDP groups take every ep-th
  rank, ``{0, ep, 2ep, …}, {1, ep+1, …}, …``. Example W=4, ep=2: EP {0,1},{2,3}; EDP {0,2},{1,3}.
* ``use_data_before_expert_parallel=True`` ("D+E"): EDP groups are consecutive blocks of W/ep ranks and EP
  groups take every (W/ep)-th rank. Example W=4, ep=2: EP {0,2},{1,3}; EDP {0,1},{2,3}.

Within an EP group, rank r (its index in the group) holds global experts ``r*E_local … (r+1)*E_local-1``.
Groups are cached per name ``ep_size_{ep}`` (DeepSpeed's name, also the ``group_name`` tag of expert
parameters and the optimiser group name), so every MoE layer with the same ep shares them.
``torch.distributed.new_group`` is collective: every rank must create the groups in the same order, which
happens naturally when every rank builds the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from deepnvme._core.checks import check_int


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the groups (and optimiser groups) of expert-parallel size ``ep_size``."""
    return f"ep_size_{ep_size}"


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups for one ep size; ``None`` means 'just this rank' (no communication)."""

    ep_size: int
    ep_group: Any
    edp_group: Any
    ep_rank: int
    data_before_expert: bool


_GROUPS: dict[str, ExpertGroups] = {}
_WORLD: list[Any] = [None]  # the default process group the cached groups belong to


def _drop_stale() -> None:
    """Forget cached groups once their default process group was destroyed or replaced."""
    live = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if live is not _WORLD[0]:
        _GROUPS.clear()
        _WORLD[0] = live


def ranks_layout(
    world_size: int, ep_size: int, data_before_expert: bool = False
) -> tuple[list[list[int]], list[list[int]]]:
    """The EP groups and EDP groups (lists of ranks) for a world, without creating anything."""
    check_int("ep_size", ep_size)
    if world_size % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide the world size ({world_size})")
    edp = world_size // ep_size
    if data_before_expert:
        ep_groups = [list(range(i, world_size, edp)) for i in range(edp)]
        edp_groups = [list(range(j * edp, (j + 1) * edp)) for j in range(ep_size)]
    else:
        ep_groups = [list(range(i * ep_size, (i + 1) * ep_size)) for i in range(edp)]
        edp_groups = [list(range(j, world_size, ep_size)) for j in range(ep_size)]
    return ep_groups, edp_groups


def create_expert_and_data_parallel_groups(
    ep_size: int, use_data_before_expert_parallel: bool = False
) -> ExpertGroups:
    """Create (once per ep size) and return this rank's EP and EDP groups; collective over the whole world.

    Without an initialised torch.distributed only ep_size 1 is possible and both groups are ``None``.
    """
    name = expert_group_name(ep_size)
    _drop_stale()
    found = _GROUPS.get(name)
    if found is not None:
        if found.data_before_expert != bool(use_data_before_expert_parallel):
            raise ValueError(
                f"use_data_before_expert_parallel: groups {name} already exist with the other layout"
            )
        return found
    if not (dist.is_available() and dist.is_initialized()):
        if ep_size != 1:
            raise ValueError(
                f"ep_size={ep_size} needs torch.distributed to be initialised first (init_process_group)"
            )
        return ExpertGroups(1, None, None, 0, bool(use_data_before_expert_parallel))
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_groups, edp_groups = ranks_layout(world, ep_size, bool(use_data_before_expert_parallel))
    mine_ep = mine_edp = None
    ep_rank = 0
    for ranks in ep_groups:
        group = dist.new_group(ranks) if ep_size > 1 else None
        if rank in ranks:
            mine_ep, ep_rank = group, ranks.index(rank)
    for ranks in edp_groups:
        group = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
        if rank in ranks:
            mine_edp = group
    groups = ExpertGroups(ep_size, mine_ep, mine_edp, ep_rank, bool(use_data_before_expert_parallel))
    _GROUPS[name] = groups
    return groups


def groups_named(name: str) -> ExpertGroups | None:
    """The groups already created under ``name``, or None."""
    _drop_stale()
    return _GROUPS.get(name)


def get_expert_parallel_group(name: str) -> Any:
    """The EP group registered under ``name`` (``ep_size_{ep}``); KeyError names it if it does not exist."""
    return _registered(name, "expert-parallel").ep_group


def get_expert_data_parallel_group(name: str) -> Any:
    """The EDP group registered under ``name``; ``None`` means this rank alone (no torch.distributed)."""
    return _registered(name, "expert-data-parallel").edp_group


def _registered(name: str, kind: str) -> Any:
    """The groups registered under ``name``; KeyError naming it and the `kind` asked for if there are none."""
    _drop_stale()
    if name not in _GROUPS:
        raise KeyError(f"no {kind} groups named {name!r}; build an MoE layer with that ep_size first")
    return _GROUPS[name]


def _ep_size_of(group_name: str) -> int:
    """The ep size encoded in a DeepSpeed group name ``ep_size_{ep}``."""
    prefix = "ep_size_"
    digits = group_name[len(prefix) :] if isinstance(group_name, str) else ""
    if not isinstance(group_name, str) or not group_name.startswith(prefix) or not digits.isdigit():
        raise ValueError(f"expert parameter group_name must look like 'ep_size_<n>', got {group_name!r}")
    return int(digits)


def edp_group_of(group_name: str) -> Any:
    """The expert-data-parallel group for expert parameters tagged ``group_name`` (created if needed)."""
    groups = groups_named(group_name) or create_expert_and_data_parallel_groups(_ep_size_of(group_name))
    return groups.edp_group


def reset_groups() -> None:
    """Forget the cached groups (done by itself when the default process group is replaced)."""
    _GROUPS.clear()
