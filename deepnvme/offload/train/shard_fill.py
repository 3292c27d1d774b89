"""The shards of an FSDP2 model built on the meta device, made and filled from a checkpoint one unit at a
time (offload_shards(..., checkpoint=)): each parameter's shard on this rank is read alone from the
checkpoint (its rows, for FSDP2's default sharding on the first dimension), so neither the model nor this
rank's whole shard is ever in memory.

The shard replaces the meta parameter as a DTensor of the same mesh, placements, shape and stride (made by
DTensor.from_local) wherever the model holds it (tied parameters once); FSDP2 takes the new parameters at
its lazy initialisation in the first forward, as it does after `to_empty()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepnvme.offload.model import tensor_aliases
from deepnvme.offload.stores import StoreError
from deepnvme.offload.train.model_io import Checkpoint, converted

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch without distributed support
    DTensor = Shard = None  # type: ignore[assignment,misc]


def rows_of(p: torch.Tensor) -> tuple[int, int]:
    """The rows of the whole parameter this rank's shard holds: FSDP2 chunks the first dimension as
    torch.chunk does (every rank but the last ones ceil(rows / ranks), the last ones fewer or none)."""
    (placement,) = p.placements  # type: ignore[attr-defined]
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise ValueError(f"a parameter of shape {tuple(p.shape)} is sharded as {placement}: filling from a "
                         "checkpoint takes FSDP2's default sharding on the first dimension")
    mesh = p.device_mesh  # type: ignore[attr-defined]
    n, ranks, rank = p.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-n // ranks)
    start = min(n, rank * chunk)
    stop = min(n, start + chunk)
    if stop - start != p.to_local().shape[0]:  # type: ignore[attr-defined]
        raise ValueError(f"a parameter of shape {tuple(p.shape)} holds {p.to_local().shape[0]} rows on this "  # type: ignore[attr-defined]
                         f"rank, not rows {start}:{stop} as FSDP2's sharding would: not filled")
    return start, stop


def fill_unit(model: nn.Module, params: Sequence[nn.Parameter], ckpt: Checkpoint) -> list[nn.Parameter]:
    """Make `params` (meta DTensors of one unit) real from `ckpt`, each rank its own rows; the new
    parameters, in order (a parameter already real is kept)."""
    names = {id(t): n for n, t in tensor_aliases(model)}
    made: dict[int, nn.Parameter] = {}
    out = []
    for p in params:
        if not p.is_meta:
            out.append(p)
            continue
        aliases = names[id(p)]
        key = ckpt.find(model, aliases)
        if key is None:
            raise StoreError(f"{aliases[0]} is on the meta device and {ckpt.path} does not hold it")
        start, stop = rows_of(p)
        local = p.to_local()  # type: ignore[attr-defined]
        with ckpt.rows(key, start, stop) as v:
            value = converted(v, local, aliases[0], ckpt.path).clone()
        shard = DTensor.from_local(value, device_mesh=p.device_mesh, placements=p.placements,  # type: ignore[attr-defined]
                                   run_check=False, shape=p.shape, stride=p.stride())
        new = nn.Parameter(shard, requires_grad=p.requires_grad)
        made[id(p)] = new
        out.append(new)
    for mod in model.modules():
        for attr, x in list(mod._parameters.items()):
            if x is not None and id(x) in made:
                mod._parameters[attr] = made[id(x)]
    return out
