"""MoE model checkpoints in DeepSpeed's engine layout: one file per expert, one for everything else.

    <save_dir>/<tag>/mp_rank_00_model_states.pt          non-expert weights, num_experts, client state
    <save_dir>/<tag>/layer_{L}_expert_{G}_mp_rank_00_model_states.pt   expert G of MoE layer L (global id)
    <save_dir>/latest                                     the newest tag

MoE layers are numbered 0, 1, ... in named_modules() order; inside an expert file the keys carry the global
expert id (DeepSpeed's renaming), so a model built at any expert-parallel size that divides the experts loads
the same files: each rank reads the experts it holds and renames them to its local slots. Every tensor is
cloned before it is written, so a file holds its own expert only (DeepSpeed #2389). Only the ranks that are
first in their expert-data-parallel group write experts, and only rank 0 writes the main file. Files are
written with deepnvme.save (torch's format: torch.load and DeepSpeed read them), read with deepnvme.load.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from deepnvme._core.errors import CheckpointFormatError
from deepnvme._core.files import write_atomically
from deepnvme.moe.experts import EXPERT_KEY, expert_ranks

MAIN_FILE = "mp_rank_00_model_states.pt"
LATEST_FILE = "latest"


def expert_file(layer: int, expert: int) -> str:
    """File name of global expert `expert` of MoE layer `layer`."""
    return f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def _write(obj: Any, path: str) -> None:
    """Write one checkpoint file with deepnvme's checkpoint writer (atomic, payloads straight from memory)."""
    from deepnvme.serialization import save

    save(obj, path)


def _read(path: str) -> Any:
    """Read one checkpoint file onto the CPU, tensors and plain containers only."""
    from deepnvme.serialization import load

    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "checkpoint file missing", path)
    return load(path, map_location="cpu", weights_only=True)


def _checked_tag(tag: Any, where: str) -> str:
    """`tag` when it names a folder directly inside the checkpoint directory; ValueError otherwise (an
    absolute path, `..`, `.`, a separator or NUL would put the files elsewhere)."""
    if (not isinstance(tag, str) or not tag or tag in (".", "..") or "\0" in tag
            or os.sep in tag or (os.altsep and os.altsep in tag)):
        raise ValueError(f"{where} must name a folder inside the checkpoint directory (no '{os.sep}', not "
                         f"'.' or '..'), got {tag!r}")
    return tag


def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every MoE layer, in the order checkpoints number them."""
    from deepnvme.moe import MoE

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _layer_prefix(name: str) -> str:
    return f"{name}.deepspeed_moe.experts.deepspeed_experts."


def save_moe_checkpoint(
    model: nn.Module, save_dir: str, tag: str, client_state: Mapping[str, Any] | None = None
) -> str:
    """Write this rank's share of checkpoint `tag` of `model` (call it on every rank); returns the folder."""
    import torch.distributed as dist

    _checked_tag(tag, "tag")
    rank = _rank()
    folder = os.path.join(save_dir, tag)
    os.makedirs(folder, exist_ok=True)
    state = model.state_dict()
    layers = _moe_layers(model)
    for layer_id, (name, layer) in enumerate(layers):
        ep_rank, edp_rank = expert_ranks(layer)
        if edp_rank != 0:
            continue
        prefix = _layer_prefix(name)
        per_expert: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            m = EXPERT_KEY.match(key)
            if m is None or not key.startswith(prefix):
                continue
            global_id = ep_rank * layer.num_local_experts + int(m.group("local"))
            per_expert.setdefault(global_id, {})[f"{prefix}{global_id}.{m.group('rest')}"] = (
                value.detach().clone()
            )
        for global_id, expert_state in sorted(per_expert.items()):
            _write(expert_state, os.path.join(folder, expert_file(layer_id, global_id)))
    if rank == 0:
        main = dict(client_state or {})
        main["module"] = {k: v for k, v in state.items() if EXPERT_KEY.match(k) is None}
        main["num_experts"] = [int(layer.num_experts) for _, layer in layers]
        _write(main, os.path.join(folder, MAIN_FILE))
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        dist.barrier()  # every file of the tag is written before `latest` names it
    if rank == 0:
        write_atomically(os.path.join(save_dir, LATEST_FILE), tag.encode())
    if distributed:
        dist.barrier()  # and no rank returns (and maybe reads `latest`) before it is there
    return folder


def latest_tag(load_dir: str) -> str:
    """The tag named by `<load_dir>/latest`."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "no 'latest' file in the checkpoint folder", path)
    with open(path, "rb") as f:
        text = f.read(4096)
    try:
        tag = text.decode().strip()
    except UnicodeDecodeError as exc:
        raise CheckpointFormatError(path, "not a tag (not UTF-8 text)") from exc
    try:
        return _checked_tag(tag, "the tag in 'latest'")
    except ValueError as exc:
        raise CheckpointFormatError(path, str(exc)) from exc


def read_client_state(load_dir: str, tag: str | None = None) -> dict[str, Any]:
    """Everything in the main file except the weights (e.g. the model config saved beside them)."""
    tag = latest_tag(load_dir) if tag is None else _checked_tag(tag, "tag")
    main = _read(os.path.join(load_dir, tag, MAIN_FILE))
    return {k: v for k, v in main.items() if k != "module"}


def load_moe_checkpoint(model: nn.Module, load_dir: str, tag: str | None = None) -> dict[str, Any]:
    """Load `tag` (default: latest) into `model` at its own expert-parallel size; returns the client state.

    The experts per MoE layer must match the saved ones; the expert-parallel size may differ.
    """
    tag = latest_tag(load_dir) if tag is None else _checked_tag(tag, "tag")
    folder = os.path.join(load_dir, tag)
    main_path = os.path.join(folder, MAIN_FILE)
    main = _read(main_path)
    if (not isinstance(main, dict) or not isinstance(main.get("module"), dict)
            or not isinstance(main.get("num_experts"), list)):
        raise CheckpointFormatError(main_path, "not an MoE model checkpoint (no 'module' or 'num_experts')")
    layers = _moe_layers(model)
    ours = [int(layer.num_experts) for _, layer in layers]
    if list(main["num_experts"]) != ours:
        raise ValueError(
            f"{main_path}: saved with experts per MoE layer {list(main['num_experts'])}, the model has {ours}"
        )
    state = dict(main["module"])
    for layer_id, (name, layer) in enumerate(layers):
        ep_rank, _ = expert_ranks(layer)
        prefix = _layer_prefix(name)
        for local in range(layer.num_local_experts):
            global_id = ep_rank * layer.num_local_experts + local
            path = os.path.join(folder, expert_file(layer_id, global_id))
            expert = _read(path)
            if not isinstance(expert, dict):
                raise CheckpointFormatError(path, f"an expert file holds a {type(expert).__name__}, not a "
                                            "dict")
            for key, value in expert.items():
                if not isinstance(key, str) or not key.startswith(f"{prefix}{global_id}."):
                    raise CheckpointFormatError(path, f"key {key!r} is not expert {global_id} of layer "
                                                f"{name!r}")
                state[f"{prefix}{local}.{key[len(prefix) + len(str(global_id)) + 1 :]}"] = value
    model.load_state_dict(state)
    return {k: v for k, v in main.items() if k != "module"}
