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
copied onto the drive before the next: memory holds one unit's at a time. A last dcp.load takes the rest
(buffers, parameters outside the units, the optimizer's hyperparameters and `extra`).
"""

from __future__ import annotations

import mmap
import os
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
from deepnvme.offload.train.shards import ShardUnit, fsdp_groups, unit_of

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
    """The shards of one unit, and the state of one parameter, read at a time (the writer asks in the state
    dict's order: unit after unit, parameter after parameter)."""

    def __init__(self, optimizer: OffloadedOptimizer | None) -> None:
        self.optimizer = optimizer
        self.unit: ShardUnit | None = None
        self.shards: dict[int, torch.Tensor] = {}
        self.param: torch.Tensor | None = None
        self.state: dict[str, Any] = {}

    def shard(self, u: ShardUnit, p: torch.Tensor) -> torch.Tensor:
        if self.unit is not u or id(p) not in self.shards:
            self.shards, self.unit = {}, None
            self.shards = dict(zip(map(id, u.params), u.owner.copies(u)))
            self.unit = u
        return self.shards.pop(id(p))

    def state_of(self, view: torch.Tensor, key: str) -> torch.Tensor:
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


def _untouched(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over anonymous memory never touched (no memory used until written)."""
    n = shape.numel() * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8).view(dtype).view(shape)


def _check(model: nn.Module, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the torch.nn.Module given to offload_shards, got "
                        f"{type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, OffloadedOptimizer):
        raise TypeError(f"optimizer must be an OffloadedOptimizer (or None: the model only), got "
                        f"{type(optimizer).__name__}")


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


def dcp_save(path: str | os.PathLike, model: nn.Module, optimizer: OffloadedOptimizer | None = None, *,
             extra: dict[str, Any] | None = None, storage_writer: Any = None) -> None:
    """Save `model` (offloaded by offload_shards) and `optimizer` (its OffloadedOptimizer, or None) with
    torch.distributed.checkpoint to folder `path`, as torch's FSDP2 code would (see the module docstring),
    streamed from the drive; `extra` (tensors and picklable values: the step, an LR scheduler's
    state_dict()) is saved beside them. Collective: every rank calls it. `storage_writer` defaults to
    deepnvme's AioStorageWriter(path)."""
    _check(model, optimizer)
    if extra is not None and ({MODEL, OPTIM} & set(extra)):
        raise ValueError(f"extra may not use the keys {MODEL!r} and {OPTIM!r} (the model's and optimizer's)")
    owners = {id(u.owner): u.owner for p in model.parameters() if (u := unit_of(p)) is not None}
    for owner in owners.values():
        owner.settle()  # units still brought are given back, writes done: the drive holds every shard
        owner.space.check_files()
    reads = _Reads(optimizer)
    sources: dict[int, Callable[[], torch.Tensor]] = {}
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    model_sd = model.state_dict()
    for name, value in model_sd.items():
        u = unit_of(params[name]) if name in params else None
        if u is not None:
            sources[id(value)] = lambda u=u, p=params[name]: reads.shard(u, p)
    state: dict[str, Any] = {"model": model_sd, **(extra or {})}
    if optimizer is not None:
        per_param: dict[str, dict[str, Any]] = {}
        names = _names(model)
        for p in model.parameters():
            view = optimizer.stepped_as(p)
            outline = {} if view is None else optimizer.state.get(view, {})
            if not outline:
                continue
            st: dict[str, Any] = {}
            for key, v in outline.items():
                if isinstance(v, torch.Tensor) and v.is_meta:
                    st[key] = _like(p, _untouched(v.shape, v.dtype))
                    sources[id(st[key])] = lambda view=view, key=key: reads.state_of(view, key)
                else:
                    st[key] = v
            per_param[names[id(p)][0]] = st
        state[OPTIM] = {"state": per_param, "param_groups": _groups_by_name(model, optimizer)}
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
    _check(model, optimizer)
    reader = AioStorageReader(path) if storage_reader is None else storage_reader
    saved = reader.read_metadata().state_dict_metadata
    names = _names(model)
    _check_saved(saved, path, [(name, p) for _, _, params in fsdp_groups(model) for p in params
                              for name in names[id(p)]])
    done: set[str] = set()
    for _, _, params in fsdp_groups(model):
        _load_unit(path, reader, saved, names, params, optimizer)
        done.update(n for p in params for n in names[id(p)])
    rest: dict[str, Any] = {MODEL: {k: v for k, v in model.state_dict().items() if k not in done}}
    if optimizer is not None:
        rest[OPTIM] = {"param_groups": _groups_by_name(model, optimizer)}
    rest.update(extra or {})
    _collective(lambda: dcp.load(rest, checkpoint_id=path, storage_reader=reader))
    return_freed_memory()
    if optimizer is not None:
        for live, got in zip(optimizer.param_groups, rest[OPTIM]["param_groups"]):
            live.update({k: v for k, v in got.items() if k != "params"})
    return {k: rest[k] for k in (extra or {})}


def _check_saved(saved: dict[str, Any], path: str | os.PathLike,
                 params: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse, before anything is loaded, a checkpoint that lacks a parameter or holds it in another shape
    or dtype (a unit loaded before the error would leave the model half replaced)."""
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
    values = [_local(sd[MODEL][names[id(p)][0]]) for p in params]
    units = {id(u): u for p in params if (u := unit_of(p)) is not None}
    for u in units.values():
        u.owner.assign(u, [values[next(i for i, q in enumerate(params) if q is p)] for p in u.params])
    with torch.no_grad():
        for p, v in zip(params, values):
            if unit_of(p) is None:
                (p.to_local() if is_dtensor(p) else p).copy_(v)
    if optimizer is not None and states:
        loaded = sd[OPTIM]["state"]
        optimizer.write_states({optimizer.stepped_as(p): {k: _local(v) for k, v in loaded[name].items()}
                                for p in params if (name := names[id(p)][0]) in loaded})


def _collective(run: Callable[[], Any]) -> Any:
    """Run a DCP save or load; a rank's failure, which DCP raises on every rank as a CheckpointException
    (a BaseException: `except Exception` misses it), is raised as that rank's own error, named: an OSError
    keeps its errno and file and says which rank met it."""
    try:
        return run()
    except CheckpointException as exc:
        rank, (first, _) = min(exc.failures.items())
        if isinstance(first, OSError):
            raise OSError(first.errno, f"rank {rank}: {first.strerror or first}", first.filename) from exc
        if isinstance(first, (ValueError, TypeError, RuntimeError, KeyError, MemoryError)):
            raise type(first)(f"rank {rank}: {first}") from exc
        raise RuntimeError(f"rank {rank}: {type(first).__name__}: {first}") from exc


def _local(v: Any) -> Any:
    return v.to_local() if is_dtensor(v) else v


__all__ = ["HELD_BYTES", "dcp_load", "dcp_save"]
