"""Training offloaded by offload_shards saved and resumed through torch.distributed.checkpoint (DCP), streamed
from and to the drive: a rank's shard is never all in memory.

The checkpoint is the one torch's own FSDP2 code writes, `{"model": get_model_state_dict(model), "optim":
get_optimizer_state_dict(model, optimizer), **extra}` in DCP's format (through deepnvme's AioStorageWriter
unless another writer is given). So it resumes on any number of ranks (DCP reshards each tensor to the
loading ranks' shards), offloaded or not, torch's `set_state_dict` loads it into a model trained in memory,
and a checkpoint torch saved from such a model resumes here.

Saving is one dcp.save. The state dict it is given holds the parameters (their shards show the drive's
bytes through their mappings, untouched) and, for the optimizer's state, DTensors over untouched anonymous
memory shaped and placed like the state. The save planner reads a unit's shards (checked against their
CRC-32) and a parameter's state from the drive only when the writer asks for them, as fresh tensors the
writer frees once written; the writer lets at most two gathered units' bytes of them wait for their
writes (the room a step's gathered units take, free while no step runs).

Loading is one dcp.load per unit (each module fully_shard was applied to, in the model's order: the same
on every rank, as DCP's collectives need), of that unit's parameters and their optimizer state into memory,
copied onto the drive before the next: memory holds one unit's at a time. The optimizer's hyperparameters
are read first and matched to its groups by their parameters' names; a last dcp.load takes the rest
(buffers, parameters outside the units, `extra`). Until that one is done the model refuses forwards and the
optimizer steps: a damaged file is found only as each unit is read.

Every rank makes the same DCP calls in the same order; what a rank does between them (checking its swap
files, placing a loaded unit) is agreed on (rank_errors.agree) before the next call, so that one rank's
failure is raised on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from deepnvme.offload._doors import AioStorageReader, AioStorageWriter
from deepnvme.offload.swap import return_freed_memory
from deepnvme.offload.train.dtensors import is_dtensor
from deepnvme.offload.train.optimizer import OffloadedOptimizer
from deepnvme.offload.train.rank_errors import agree, raise_named, world
from deepnvme.offload.train.records import untouched
from deepnvme.offload.train.shard_units import ShardUnit, fsdp_groups, unit_of

#: Bytes of tensors read for a save that may wait for their writes, for a model not offloaded.
HELD_BYTES = 64 << 20
MODEL, OPTIM = "model", "optim"


class _StreamedSave(DefaultSavePlanner):
    """DCP's default save planner, except that tensors with a source are read from it when written."""

    def __init__(self, sources: dict[int, Callable[[], torch.Tensor]], held_bytes: int) -> None:
        super().__init__()
        self._sources = sources
        self.held_bytes_limit = held_bytes  # AioStorageWriter counts what resolve_data hands over against it

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            source = self._sources.get(id(self.state_dict.get(write_item.index.fqn)))
            if source is not None:
                return source()
        return super().resolve_data(write_item)


class _Reads:
    """The shards of one unit, and the state of one parameter, read at a time: deepnvme's writer asks in
    the state dict's order, unit after unit, parameter after parameter (a writer that orders its items
    otherwise, or asks from several threads, costs reads of a unit again, not wrong bytes)."""

    def __init__(self, optimizer: OffloadedOptimizer | None) -> None:
        self.optimizer = optimizer
        self.unit: ShardUnit | None = None
        self.shards: dict[int, torch.Tensor] = {}
        self.param: torch.Tensor | None = None
        self.state: dict[str, Any] = {}
        self.lock = threading.Lock()  # a writer of several threads (thread_count > 1) asks from each

    def shard(self, u: ShardUnit, p: torch.Tensor) -> torch.Tensor:
        with self.lock:
            if self.unit is not u or id(p) not in self.shards:
                self.shards, self.unit = {}, None
                self.shards = dict(zip(map(id, u.params), u.owner.copies(u)))
                self.unit = u
            return self.shards.pop(id(p))

    def state_of(self, view: torch.Tensor, key: str) -> torch.Tensor:
        with self.lock:
            if self.param is not view or key not in self.state:
                self.state, self.param = {}, None
                self.state = self.optimizer.read_state(view)  # type: ignore[union-attr]
                self.param = view
            return self.state.pop(key)


def _names(model: nn.Module) -> dict[int, list[str]]:
    """Each parameter's names (a tied one has several), by id."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as the DTensor placed like DTensor `p` (its local shard); `local` when `p` is no DTensor."""
    if not is_dtensor(p):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _owners(model: nn.Module) -> dict[int, Any]:
    """The OffloadedShards keeping `model`'s shards (by id)."""
    return {id(u.owner): u.owner for p in model.parameters() if (u := unit_of(p)) is not None}


def _check_extra(extra: Any) -> None:
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of what is saved beside the model, got {type(extra).__name__}")
    if extra is not None and ({MODEL, OPTIM} & set(extra)):
        raise ValueError(f"extra may not use the keys {MODEL!r} and {OPTIM!r} (the model's and optimizer's)")


def _check(model: nn.Module, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the torch.nn.Module given to offload_shards, got "
                        f"{type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, OffloadedOptimizer):
        raise TypeError(f"optimizer must be an OffloadedOptimizer (or None: the model only), got "
                        f"{type(optimizer).__name__}")
    for _, m, _ in fsdp_groups(model):  # a backward that raised part way leaves units gathered
        m.reshard()


def _groups_by_name(model: nn.Module, optimizer: OffloadedOptimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups as torch's get_optimizer_state_dict gives them: parameters by name."""
    names = _names(model)
    by_view: dict[int, str] = {}
    for p in model.parameters():
        view = optimizer.stepped_as(p)
        if view is not None:
            by_view[id(view)] = names[id(p)][0]
    groups = []
    for g in optimizer.param_groups:
        missing = [i for i, v in enumerate(g["params"]) if id(v) not in by_view]
        if missing:
            raise ValueError(f"the optimizer steps parameter {missing[0]} of a group that is not model's: "
                             "a checkpoint names the state of model's parameters only")
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [by_view[id(v)] for v in g["params"]]})
    return groups


def _save_state(model: nn.Module, optimizer: OffloadedOptimizer | None, extra: dict[str, Any] | None,
                owners: dict[int, Any], reads: _Reads, sources: dict[int, Callable[[], torch.Tensor]]
                ) -> dict[str, Any]:
    """The state dict dcp_save gives DCP, with `sources` (by id of a value) reading what is on the drive."""
    for owner in owners.values():
        owner.settle()  # units still brought are given back, writes done: the drive holds every shard
        owner.space.check_files()
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    model_sd = model.state_dict()
    for name, value in model_sd.items():
        u = unit_of(params[name]) if name in params else None
        if u is not None:
            sources[id(value)] = lambda u=u, p=params[name]: reads.shard(u, p)
    state: dict[str, Any] = {MODEL: model_sd, **(extra or {})}
    if optimizer is None:
        return state
    per_param: dict[str, dict[str, Any]] = {}
    names = _names(model)
    for p in model.parameters():
        view = optimizer.stepped_as(p)
        outline = {} if view is None else optimizer.state.get(view, {})
        if outline:
            per_param[names[id(p)][0]] = _state_of(p, view, outline, names[id(p)][0], reads, sources)
    state[OPTIM] = {"state": per_param, "param_groups": _groups_by_name(model, optimizer)}
    return state


def _state_of(p: torch.Tensor, view: Any, outline: dict[str, Any], name: str, reads: _Reads,
              sources: dict[int, Callable[[], torch.Tensor]]) -> dict[str, Any]:
    """One parameter's optimizer state for DCP: what is on the drive as placeholders placed like the
    parameter (read when written), tensors shaped like its local shard (an empty shard's state) placed
    like it too, small values as they are."""
    local = p.to_local().shape if is_dtensor(p) else p.shape
    st: dict[str, Any] = {}
    for key, v in outline.items():
        if isinstance(v, torch.Tensor) and v.is_meta:
            if v.shape != local:
                raise TypeError(f"the optimizer's state {key!r} of {name} is shaped {tuple(v.shape)}, not "
                                f"like the parameter's shard {tuple(local)}: dcp_save places each state "
                                "tensor as its parameter is sharded, and cannot place this one")
            st[key] = _like(p, untouched(v.shape, v.dtype))
            sources[id(st[key])] = lambda view=view, key=key: reads.state_of(view, key)
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == local:
            st[key] = _like(p, v)  # the state of a shard with no element on this rank
        else:
            st[key] = v
    return st


def dcp_save(path: str | os.PathLike, model: nn.Module, optimizer: OffloadedOptimizer | None = None, *,
             extra: dict[str, Any] | None = None, storage_writer: Any = None) -> None:
    """Save `model` (offloaded by offload_shards) and `optimizer` (its OffloadedOptimizer, or None) with
    torch.distributed.checkpoint to folder `path`, as torch's FSDP2 code would (see the module docstring),
    streamed from the drive; `extra` (tensors and picklable values: the step, an LR scheduler's
    state_dict()) is saved beside them. Collective: every rank calls it. `storage_writer` defaults to
    deepnvme's AioStorageWriter(path)."""
    agree(lambda: (_check(model, optimizer), _check_extra(extra)), world())  # one rank's is every rank's
    owners = _owners(model)
    reads = _Reads(optimizer)
    sources: dict[int, Callable[[], torch.Tensor]] = {}
    state = agree(lambda: _save_state(model, optimizer, extra, owners, reads, sources), world())
    writer = AioStorageWriter(path) if storage_writer is None else storage_writer
    held = min((2 * o.gathered_bytes for o in owners.values()), default=HELD_BYTES)
    try:
        _collective(lambda: dcp.save(state, storage_writer=writer, planner=_StreamedSave(sources, held)))
    finally:
        return_freed_memory()  # the copies' memory back to the system, not kept by the allocator


def dcp_load(path: str | os.PathLike, model: nn.Module, optimizer: OffloadedOptimizer | None = None, *,
             extra: dict[str, Any] | None = None, storage_reader: Any = None) -> dict[str, Any]:
    """Load into `model` (offloaded by offload_shards, on any number of ranks) and `optimizer` what
    dcp_save (or torch's FSDP2 code: `{"model": ..., "optim": ...}`) saved in folder `path`, a unit at a
    time onto the drive (see the module docstring); `extra` is the template of what was saved beside them
    (DCP loads into what it is given), filled in place and returned. The optimizer's state is replaced
    for the parameters the checkpoint has state for. Collective: every rank calls it."""
    agree(lambda: (_check(model, optimizer), _check_extra(extra)), world())  # one rank's is every rank's
    reader = AioStorageReader(path) if storage_reader is None else storage_reader
    names = _names(model)

    def checked() -> dict[str, Any]:
        saved = reader.read_metadata().state_dict_metadata
        _check_saved(saved, path, [(name, p) for _, _, params in fsdp_groups(model) for p in params
                                  for name in names[id(p)]], optimizer, extra or {})
        return saved

    saved = agree(checked, world())
    hyper = None if optimizer is None else _saved_groups(path, reader, model, optimizer)
    owners = _owners(model)
    # Damaged bytes are found only as a unit is read: until the last load is done, the model and the
    # optimizer are a mix, and refuse to train.
    why = f"a dcp_load of {os.fspath(path)} did not complete"
    for owner in owners.values():
        owner.refuse_use(why)
    if optimizer is not None:
        optimizer.refuse_steps(why)
    done: set[str] = set()
    for _, _, params in fsdp_groups(model):
        _load_unit(path, reader, saved, names, params, optimizer)
        done.update(n for p in params for n in names[id(p)])
    rest: dict[str, Any] = {MODEL: {k: v for k, v in model.state_dict().items() if k not in done}}
    rest.update(extra or {})
    _collective(lambda: dcp.load(rest, checkpoint_id=path, storage_reader=reader))
    return_freed_memory()
    if optimizer is not None:
        for live, got in zip(optimizer.param_groups, hyper):  # type: ignore[arg-type]
            live.update(got)
        optimizer.refuse_steps(None)
    for owner in owners.values():
        owner.refuse_use(None)
    return {k: rest[k] for k in (extra or {})}


def _saved_groups(path: str | os.PathLike, reader: Any, model: nn.Module,
                  optimizer: OffloadedOptimizer) -> list[dict[str, Any]]:
    """The saved hyperparameters of each of the optimizer's groups, matched by its parameters' names (as
    torch's set_optimizer_state_dict matches them), read before anything else is: a group that matches
    none is refused while nothing has changed."""
    live = _groups_by_name(model, optimizer)
    sd = {OPTIM: {"param_groups": [dict(g) for g in live]}}
    _collective(lambda: dcp.load(sd, checkpoint_id=path, storage_reader=reader))

    def matched() -> list[dict[str, Any]]:
        by_names = {frozenset(g["params"]): g for g in sd[OPTIM]["param_groups"]}
        out = []
        for i, g in enumerate(live):
            got = by_names.get(frozenset(g["params"]))
            if got is None:
                raise ValueError(f"{os.fspath(path)}: the optimizer's param group {i} ({len(g['params'])} "
                                 "parameters, from " f"{g['params'][0] if g['params'] else 'none'}) matches "
                                 "no saved group by its parameters' names")
            out.append({k: v for k, v in got.items() if k != "params"})
        return out

    return agree(matched, world())


def _check_saved(saved: dict[str, Any], path: str | os.PathLike, params: list[tuple[str, torch.Tensor]],
                 optimizer: OffloadedOptimizer | None, extra: dict[str, Any]) -> None:
    """Refuse, before anything is loaded, a checkpoint that lacks a parameter or holds it in another shape
    or dtype, lacks the optimizer's hyperparameters when an optimizer is given, or a key of `extra` (a
    unit loaded before the error would leave the model half replaced)."""
    groups = {k.split(".")[2] for k in saved if k.startswith(f"{OPTIM}.param_groups.")}
    if optimizer is not None and not groups:
        raise ValueError(f"{os.fspath(path)}: the checkpoint holds no optimizer state (saved with "
                         "optimizer=None?): pass optimizer=None to load the model alone")
    if optimizer is not None and len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{os.fspath(path)}: the checkpoint holds {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for key in extra:
        if not any(k == key or k.startswith(f"{key}.") for k in saved):
            raise ValueError(f"{os.fspath(path)}: extra asks for {key!r}, which the checkpoint does not hold")
    for name, p in params:
        md = saved.get(f"{MODEL}.{name}")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{os.fspath(path)}: the checkpoint holds no tensor {MODEL}.{name} (not this "
                             "model's checkpoint, or saved without it)")
        if md.size != p.shape or md.properties.dtype != p.dtype:
            raise ValueError(f"{os.fspath(path)}: {MODEL}.{name} is saved as {md.properties.dtype} "
                             f"{tuple(md.size)}, the model's is {p.dtype} {tuple(p.shape)}")


def _load_unit(path: str | os.PathLike, reader: Any, saved: dict[str, Any], names: dict[int, list[str]],
               params: list[nn.Parameter], optimizer: OffloadedOptimizer | None) -> None:
    """One unit's parameters and optimizer state: read into memory by one dcp.load, then put in place."""
    targets: dict[int, torch.Tensor] = {}
    model_sd: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    for p in params:
        local = p.to_local() if is_dtensor(p) else p
        targets[id(p)] = _like(p, torch.empty(local.shape, dtype=p.dtype))
        model_sd.update({n: targets[id(p)] for n in names[id(p)]})
        view = None if optimizer is None else optimizer.stepped_as(p)
        if view is None:
            continue
        prefix = f"{OPTIM}.state.{names[id(p)][0]}."
        st: dict[str, Any] = {}
        for key, md in saved.items():
            key_in = key[len(prefix):]
            if not key.startswith(prefix) or "." in key_in:
                continue
            if isinstance(md, TensorStorageMetadata):
                dtype = md.properties.dtype
                st[key_in] = (_like(p, torch.empty(local.shape, dtype=dtype)) if md.size == p.shape
                              else torch.empty(md.size, dtype=dtype))
            else:
                st[key_in] = None  # a pickled value: DCP puts what was saved in its place
        if st:
            states[names[id(p)][0]] = st
    sd: dict[str, Any] = {MODEL: model_sd}
    if states:
        sd[OPTIM] = {"state": states}
    _collective(lambda: dcp.load(sd, checkpoint_id=path, storage_reader=reader))
    agree(lambda: _place(sd, names, params, optimizer), world())


def _place(sd: dict[str, Any], names: dict[int, list[str]], params: list[nn.Parameter],
           optimizer: OffloadedOptimizer | None) -> None:
    """A unit's loaded parameters and optimizer state onto the drive (or into memory, where this rank does
    not offload the unit)."""
    values = [_local(sd[MODEL][names[id(p)][0]]) for p in params]
    units = {id(u): u for p in params if (u := unit_of(p)) is not None}
    for u in units.values():
        u.owner.assign(u, [values[next(i for i, q in enumerate(params) if q is p)] for p in u.params])
    with torch.no_grad():
        for p, v in zip(params, values):
            if unit_of(p) is None:
                (p.to_local() if is_dtensor(p) else p).copy_(v)
    if optimizer is not None and OPTIM in sd:
        loaded = sd[OPTIM]["state"]
        optimizer.write_states({optimizer.stepped_as(p): {k: _local(v) for k, v in loaded[name].items()}
                                for p in params if (name := names[id(p)][0]) in loaded})


def _collective(run: Callable[[], Any]) -> Any:
    """Run a DCP save or load; a rank's failure, which DCP raises on every rank as a CheckpointException
    (a BaseException: `except Exception` misses it), is raised as that rank's own error (raise_named)."""
    try:
        return run()
    except CheckpointException as exc:
        rank, (first, _) = min(exc.failures.items())
        raise_named(rank, first, exc)


def _local(v: Any) -> Any:
    return v.to_local() if is_dtensor(v) else v


__all__ = ["HELD_BYTES", "dcp_load", "dcp_save"]
