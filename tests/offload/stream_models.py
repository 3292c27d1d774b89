"""Tiny Hugging Face models with random weights for the streaming tests (built here, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def require_hf() -> None:
    """Skip the calling test module where the offload extra (transformers, accelerate) is missing."""
    import pytest

    for name in ("transformers", "accelerate", "safetensors"):
        pytest.importorskip(name, reason=f"{name} is needed for the streaming tests (the offload extra)")


PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
NEW_TOKENS = 32
BUDGET = 512 << 10  # two of the four blocks: reads run ahead, units are read again each forward


def config(kind: str) -> Any:
    """A GPT-2-style or Llama-style configuration of a few hundred KiB per block."""
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=96, n_positions=96, bos_token_id=0,
                             eos_token_id=0)
    return tf.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=96, max_position_embeddings=96, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0)


def build(kind: str, *, empty: bool = False) -> torch.nn.Module:
    """The model of `kind` (random weights from seed 0), or without weights (init_empty_weights)."""
    import transformers as tf

    cls = tf.GPT2LMHeadModel if kind == "gpt2" else tf.LlamaForCausalLM
    if empty:
        from accelerate import init_empty_weights

        with init_empty_weights():
            return cls(config(kind)).eval()
    torch.manual_seed(0)
    return cls(config(kind)).eval()


def save(model: torch.nn.Module, directory: Path, shard: str | None = None) -> Path:
    """save_pretrained in safetensors, sharded at `shard` (e.g. "100KB") when given."""
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, safe_serialization=True, **kw)
    return directory


def generate(model: torch.nn.Module, prompt: torch.Tensor = PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (exactly NEW_TOKENS new ones) and the logits of the whole sequence."""
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        logits = model(out).logits
    return out, logits
