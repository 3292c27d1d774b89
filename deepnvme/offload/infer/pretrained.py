"""from_pretrained: a Hugging Face model folder (config.json and safetensors, one file or shards with an
index) to a model ready for `generate()` in one call, its weights streamed from the folder's own files.

Why not a plug-in of transformers' own `from_pretrained`: its `device_map` takes devices, "cpu" and
"disk", and "disk" is accelerate's offload (weights reloaded by hooks each forward, written to an
offload folder unless the checkpoint is safetensors); a loader cannot be named there. Its other door,
a registered quantizer, is handed each tensor after transformers has read it, so the whole checkpoint
would pass through memory at load, the thing this call exists to avoid, and the quantizer methods it
would override are internal ones that changed between transformers 4 and 5.

How: the model is built on the meta device (accelerate's `init_empty_weights`, which keeps buffers such
as rotary frequencies real) through transformers' own classes from `config.json`, in the dtype
transformers' `from_pretrained` would pick, its generation settings read from `generation_config.json`
as there, then `stream_weights` reads its tensors in place from the folder: nothing is copied or written,
and memory holds the budget plus the tensors outside units (the final norm, the position tables; the
embeddings and head too unless they are streamed, see `embeddings`).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepnvme.offload.infer.weights import stream_weights
from deepnvme.offload.stores import open_store


def _dtype(dtype: Any, config: Any, folder: Path) -> torch.dtype:
    """The model's dtype: `dtype` as given, or for "auto" the config's, else the dtype of the checkpoint's
    first floating tensor, as transformers' from_pretrained picks it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype != "auto":
        found = getattr(torch, dtype, None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype (use 'auto', 'bfloat16', torch.float16)")
        return found
    if dtype != "auto":
        raise TypeError(f"dtype must be 'auto', a torch.dtype or its name, got {dtype!r}")
    own = getattr(config, "dtype", None)
    if isinstance(own, str):
        own = getattr(torch, own, None)
    if isinstance(own, torch.dtype):
        return own
    store = open_store(folder)
    try:
        first = next((i.dtype for i in store.tensors().values() if i.dtype.is_floating_point), None)
    finally:
        store.close()
    return first or torch.get_default_dtype()


def _build(model_class: Any, config: Any, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The model on the meta device, buffers real."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if hasattr(model_class, "from_config"):  # an Auto class
            return model_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        if hasattr(model_class, "_from_config"):  # a model class of transformers
            return model_class._from_config(config, dtype=dtype)
        raise TypeError(f"model_class must be a transformers model or Auto class, got {model_class!r}")


def _keep_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """transformers' rule for the modules a model class keeps in fp32 whatever the dtype asked for:
    `_keep_in_fp32_modules` when loading in fp16, `_keep_in_fp32_modules_strict` in fp16 and bf16, each a
    pattern searched in the tensor names (`*` any run of characters). Its `from_pretrained` applies it
    while loading; building from the config does not, so it is applied here, on the meta model (the reads
    convert the checkpoint's tensors to it): the same dtypes, so the same bits."""
    keep: set[str] = set()
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not keep:
        return
    pattern = re.compile("|".join(f"(?:{k.replace('*', '.*')})" for k in sorted(keep)))
    for mname, mod in model.named_modules():
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                full = f"{mname}.{attr}" if mname else attr
                if (t is None or not t.is_floating_point() or t.dtype == torch.float32
                        or not pattern.search(full)):
                    continue
                if table is mod._parameters:
                    table[attr] = nn.Parameter(t.to(torch.float32), requires_grad=t.requires_grad)
                elif attr not in mod._non_persistent_buffers_set:
                    table[attr] = t.to(torch.float32)


def from_pretrained(folder: str | os.PathLike, budget_bytes: int, *, model_class: Any = None,
                    dtype: Any = "auto", embeddings: bool | None = None, prefetch: bool = True,
                    expert_lookahead: int = 0, trust_remote_code: bool = False) -> nn.Module:
    """The model saved in `folder` (`save_pretrained`'s layout: config.json, model.safetensors or shards
    with model.safetensors.index.json, generation_config.json if any), ready for `generate()`, with the
    weights of its blocks (and experts) read from the folder's files through `budget_bytes` of locked
    memory as each runs (see the module docstring and stream_weights). Nothing is downloaded or written.

    `model_class`: the transformers class to build (default AutoModelForCausalLM). `dtype`: "auto" (the
    config's, else the checkpoint's, as transformers picks), a torch.dtype or its name; the checkpoint's
    tensors are converted as they are read when it differs. `embeddings`, `prefetch`, `expert_lookahead`:
    as in stream_weights. `unstream(model)` reads everything into memory; `stats(model)` tells what was
    read. FileNotFoundError naming the path when the folder, its config.json or its weights are missing
    (NotADirectoryError when `folder` is a file); StoreError when its weights cannot be read or do not
    match the model. Modules the model class keeps in fp32 (`_keep_in_fp32_modules`) stay fp32 as
    transformers' from_pretrained keeps them."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("deepnvme.offload.from_pretrained needs transformers and accelerate (pip install "
                          "'deepnvme[offload]')") from exc
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path, got {type(folder).__name__}")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a model folder (config.json and safetensors) is a "
                                 "directory, this is not", str(folder))
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no model folder (config.json and safetensors) at", str(folder))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(errno.ENOENT, "the model folder has no config.json",
                                str(folder / "config.json"))
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
    want = _dtype(dtype, config, folder)
    model = _build(model_class or transformers.AutoModelForCausalLM, config, want, trust_remote_code).eval()
    _keep_fp32(model, want)
    if (folder / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
    return stream_weights(model, folder, budget_bytes, embeddings=embeddings, prefetch=prefetch,
                          expert_lookahead=expert_lookahead)


__all__ = ["from_pretrained"]
