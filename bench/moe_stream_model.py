#!/usr/bin/env python3
"""The MoE model of the streaming benchmark: a Mixtral-style Hugging Face model of about 1.55 GB (fp32, random
weights, built here: nothing is downloaded), saved as a checkpoint and as deepnvme's store, and loaded the
ways the benchmark compares.

    python3 bench/moe_stream_model.py --out DIR [--scale 1.0]     # build and save (prints the paths, bytes)

From Python (what bench/stream_bench.py calls):

    import moe_stream_model as msm                   # bench/ on sys.path
    paths = msm.build_and_save(DIR)                  # {"safetensors": DIR/hf, "own": DIR/own, "bytes": N}
    model = msm.streamed(paths["own"], budget_bytes) # deepnvme from its store (or paths["safetensors"])
    model = msm.accelerate_offload(paths["safetensors"], max_memory_bytes, offload_folder)
    model = msm.in_memory(paths["safetensors"])
    deepnvme.offload.stats(model)["experts"]         # hit_rate, bytes_read, bytes_per_token, ...

The shape (hidden 1024, 8 experts of intermediate 2048 each, top-2, 7 layers, vocab 8192, grouped-query
attention 8/2 heads) puts most bytes in the experts, as in Mixtral: one expert is 25 MB, a layer's experts
201 MB, the rest of a layer 10.5 MB. A decode step at batch 1 routes to 2 experts per layer, so it needs
about 0.43 GB of the 1.55 (the I/O bound is computed from that: bytes read per token, from the statistics).
`--scale` shrinks every width (0.25: about 0.1 GB) for a quick try.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

SEED = 0


def config(scale: float = 1.0) -> Any:
    """The Mixtral-style configuration (see the module docstring); `scale` multiplies every width."""
    import transformers as tf

    def width(n: int) -> int:
        return max(64, int(n * scale) // 64 * 64)

    return tf.MixtralConfig(vocab_size=8192, hidden_size=width(1024), intermediate_size=width(2048),
                            num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=2,
                            num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            torch_dtype="float32")


def build(scale: float = 1.0) -> torch.nn.Module:
    """The model with random weights (seed 0), in eval mode."""
    import transformers as tf

    torch.manual_seed(SEED)
    return tf.MixtralForCausalLM(config(scale)).eval()


def empty(scale: float = 1.0) -> torch.nn.Module:
    """The same model without weights (accelerate's init_empty_weights), for stream_weights."""
    import transformers as tf
    from accelerate import init_empty_weights

    with init_empty_weights():
        return tf.MixtralForCausalLM(config(scale)).eval()


def build_and_save(directory: str | os.PathLike, scale: float = 1.0) -> dict[str, Any]:
    """Build the model and save it twice under `directory`: `hf` (save_pretrained: safetensors, per-expert
    tensors, sharded at 2 GB as transformers does) and `own` (deepnvme.offload.write_store: one blob per
    expert and per layer). Returns the paths and the model's bytes; an existing save is reused."""
    from deepnvme.offload import write_store

    root = Path(directory)
    hf, own, info = root / "hf", root / "own", root / "moe_model.json"
    if info.exists() and json.loads(info.read_text()).get("scale") == scale:
        return {"safetensors": hf, "own": own, **json.loads(info.read_text())}
    model = build(scale)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(hf, safe_serialization=True)
    write_store(model, own)
    meta = {"scale": scale, "bytes": nbytes, "expert_bytes": expert_bytes(model)}
    info.write_text(json.dumps(meta))
    del model
    return {"safetensors": hf, "own": own, **meta}


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of one expert (gate, up and down projections)."""
    cfg = model.config
    return 3 * cfg.hidden_size * cfg.intermediate_size * torch.finfo(torch.float32).bits // 8


def streamed(store: str | os.PathLike, budget_bytes: int, scale: float = 1.0) -> torch.nn.Module:
    """deepnvme: the model built without weights and streamed from `store` (the `hf` or `own` path) within
    `budget_bytes` of locked memory; experts are read only when routed to, through the expert cache."""
    from deepnvme.offload import stream_weights

    return stream_weights(empty(scale), store, budget_bytes)


def accelerate_offload(hf: str | os.PathLike, max_memory_bytes: int,
                       offload_folder: str | os.PathLike) -> Any:
    """Hugging Face's disk offload of the same checkpoint, as a new user would ask for it."""
    import transformers as tf

    return tf.MixtralForCausalLM.from_pretrained(
        hf, device_map="auto", max_memory={"cpu": int(max_memory_bytes)}, offload_folder=str(offload_folder),
        torch_dtype=torch.float32).eval()


def in_memory(hf: str | os.PathLike) -> Any:
    """The whole model loaded into memory."""
    import transformers as tf

    return tf.MixtralForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True,
                    help="directory for the checkpoint (hf/) and deepnvme's store (own/)")
    ap.add_argument("--scale", type=float, default=1.0, help="width multiplier (1.0: about 1.55 GB)")
    args = ap.parse_args(argv)
    paths = build_and_save(args.out, args.scale)
    json.dump({k: str(v) for k, v in paths.items()}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
