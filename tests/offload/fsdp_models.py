"""Tiny Hugging Face models sharded by torch's FSDP2 (fully_shard on each block, then on the model) for the
tests of deepnvme.offload over FSDP2; built from one seed, so every rank and every run starts alike."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 97  # odd: the embedding's rows shard unevenly over 2 ranks (49 and 48)


def build(arch: str = "llama", layers: int = 3) -> Any:
    """The model in memory, unsharded."""
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32)
    if arch == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def sharded(arch: str = "llama", *, layers: int = 3, bf16: bool = False, checkpointing: bool = False,
            meta: bool = False) -> Any:
    """The model sharded; `bf16`: FSDP2's mixed precision (fp32 shards, bf16 compute); `meta`: its
    parameters on the meta device, buffers real (accelerate's init_empty_weights)."""
    from torch.distributed import fsdp

    if meta:
        import accelerate

        with accelerate.init_empty_weights():
            m = build(arch, layers)
    else:
        m = build(arch, layers)
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = (fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else fsdp.MixedPrecisionPolicy())
    for layer in m.model.layers:
        fsdp.fully_shard(layer, mp_policy=mp)
    fsdp.fully_shard(m, mp_policy=mp)
    return m
