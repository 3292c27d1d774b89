"""An offloaded model's weights in and out of checkpoints, a tensor at a time (never the model whole in
memory): filled from a safetensors checkpoint (one file, or a folder with its index), deepnvme's own store,
or a file in torch's format (`deepnvme.save`, `torch.save`: memory-mapped); saved with `deepnvme.save` in
torch's format, each offloaded tensor read from the drive as the writer asks for it."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deepnvme.offload._doors import save_streamed
from deepnvme.offload.model import find_tensor, tensor_aliases
from deepnvme.offload.stores import StoreError, TensorInfo, open_store
from deepnvme.offload.swap import ReadAhead, SwapSpace
from deepnvme.offload.train.checkpoints import release_pages
from deepnvme.offload.train.records import untouched

if TYPE_CHECKING:
    from deepnvme.offload.train.params import OffloadedParameters


class Checkpoint:
    """A checkpoint read a tensor at a time: `find(model, names)` gives the key of a model tensor known by
    any of `names` (None when absent), `tensor(key)` a context giving its values, transient."""

    def __init__(self, path: str | os.PathLike, space: SwapSpace) -> None:
        self.path, self.space = os.fspath(path), space
        if not os.path.exists(self.path):
            raise FileNotFoundError(errno.ENOENT, "checkpoint= names nothing", self.path)
        self.store: Any = None
        self.loaded: dict[str, torch.Tensor] = {}
        if os.path.isfile(self.path) and not self.path.endswith(".safetensors"):
            try:
                sd = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
            except OSError:  # the file's own error (gone since, unreadable), with its errno and path
                raise
            except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a file that is not its own
                raise StoreError(f"{self.path}: not a checkpoint in torch's format ({exc})") from exc
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise StoreError(f"{self.path}: not a state dict (a dict of tensors by name)")
            self.loaded = sd
        else:
            self.store = open_store(self.path)
            self.infos = self.store.tensors()

    def find(self, model: nn.Module, names: list[str]) -> str | None:
        hit = find_tensor(self.infos if self.store is not None else self.loaded, model, names)
        if hit is None:
            return None
        if isinstance(hit, TensorInfo):
            return hit.name
        return next(k for k, v in self.loaded.items() if v is hit)

    @contextlib.contextmanager
    def tensor(self, key: str) -> Iterator[torch.Tensor]:
        if self.store is None:
            t = self.loaded[key]
            try:
                yield t
            finally:
                release_pages(t)
            return
        info = self.infos[key]
        name = f"checkpoint:{info.path}:{info.offset}"
        try:
            unit = self.space.unit(name)
        except KeyError:
            unit = self.space.add_external(name, info.path, info.offset, info.nbytes)
        lease = self.space.read([unit], demand=True)
        try:
            lease.wait()  # type: ignore[union-attr]
            yield lease.view(unit).view(info.dtype).view(info.shape)  # type: ignore[union-attr]
        finally:
            lease.release()  # type: ignore[union-attr]

    @contextlib.contextmanager
    def rows(self, key: str, start: int, stop: int) -> Iterator[torch.Tensor]:
        """Rows `start:stop` (of the first dimension) of tensor `key`, read alone (a rank's shard of it);
        transient, as tensor()."""
        if self.store is None:
            t = self.loaded[key]
            try:
                yield t[start:stop]
            finally:
                release_pages(t)
            return
        info = self.infos[key]
        if not info.shape:
            raise StoreError(f"{key} in {info.path} is a scalar: it has no rows to shard")
        row = info.nbytes // max(1, info.shape[0])
        offset, nbytes = info.offset + start * row, (stop - start) * row
        shape = (stop - start, *info.shape[1:])
        if nbytes == 0:
            yield torch.empty(shape, dtype=info.dtype)
            return
        name = f"checkpoint:{info.path}:{offset}:{nbytes}"
        try:
            unit = self.space.unit(name)
        except KeyError:
            unit = self.space.add_external(name, info.path, offset, nbytes)
        lease = self.space.read([unit], demand=True)
        try:
            lease.wait()  # type: ignore[union-attr]
            yield lease.view(unit).view(info.dtype).view(shape)  # type: ignore[union-attr]
        finally:
            lease.release()  # type: ignore[union-attr]

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.loaded = {}


def converted(t: torch.Tensor, like: torch.Tensor | Any, name: str, path: str) -> torch.Tensor:
    """`t` as model tensor `name` (shape and dtype of `like`): converted within a kind of dtype, else
    refused."""
    if tuple(t.shape) != tuple(like.shape):
        raise StoreError(f"{name}: {tuple(t.shape)} in {path}, {tuple(like.shape)} in the model")
    if t.dtype != like.dtype:
        if t.is_floating_point() != like.dtype.is_floating_point:
            raise StoreError(f"{name}: {t.dtype} in {path}, {like.dtype} in the model: not converted between "
                             "kinds")
        return t.to(like.dtype)
    return t


def fill_residents(owner: OffloadedParameters, ckpt: Checkpoint, offloaded: set[int]) -> None:
    """Give every tensor of the model that stays in memory (not offloaded) its value from `ckpt`: meta ones
    are made; a meta tensor the checkpoint lacks is an error naming it."""
    model = owner.model
    for names, t in tensor_aliases(model):
        if id(t) in offloaded:
            continue
        key = ckpt.find(model, names)
        if key is None:
            if t.is_meta:
                raise StoreError(f"{names[0]} is on the meta device and {ckpt.path} does not hold it: build "
                                 "the model with its buffers in memory (accelerate's init_empty_weights "
                                 "does), or give a checkpoint that has it")
            continue
        with ckpt.tensor(key) as v:
            value = converted(v, t, names[0], ckpt.path).clone()
        is_param = isinstance(t, nn.Parameter)
        new = nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value
        for _, mod in model.named_modules(remove_duplicate=False):
            for slots in (mod._parameters, mod._buffers):
                for attr, x in list(slots.items()):
                    if x is t:
                        slots[attr] = new


def save(owner: OffloadedParameters, path: str | os.PathLike) -> None:
    """The model's state_dict in torch's format at `path`, offloaded tensors read from the drive one unit
    at a time as the writer asks for them (prefetched in the order of the state dict)."""
    owner._check_open()
    sd = owner.model.state_dict(keep_vars=True)  # stand-ins as they are (detach() would raise)
    by_stand = owner.held_by_stand
    placeholders: dict[int, Any] = {}
    order = []
    for key, v in sd.items():
        h = by_stand.get(id(v))
        if h is None:
            sd[key] = v.detach()
            continue
        sd[key] = untouched(h.shape, h.dtype)
        placeholders[sd[key].untyped_storage().data_ptr()] = len(order)
        order.append(h)
    owner._settle_writes(h.data for h in order)
    reader = ReadAhead(owner.space, [[h.data] for h in order])
    held: list[Any] = [-1, None]

    def payload(storage: Any) -> Any:
        i = placeholders.get(storage.data_ptr())
        if i is None:
            return None
        if i <= held[0]:
            raise RuntimeError("the writer asked for the tensors out of order")
        while held[0] < i:
            if held[1] is not None:
                held[1].release()
            held[0] += 1
            held[1] = reader.take(held[0])
        return held[1].view(order[i].data)

    try:
        save_streamed(sd, path, payload)
    finally:
        if held[1] is not None:
            held[1].release()
        reader.close()
