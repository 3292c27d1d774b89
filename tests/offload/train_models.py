"""Models and a training loop for the parameter-offload tests: a plain nn.Sequential and tiny Hugging Face
GPT-2, Llama and Mixtral configurations (built here with random weights, nothing downloaded), trained on
seeded batches so that a model in memory and an offloaded one see the same data and dropout."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 96
KINDS = ("sequential", "gpt2", "llama", "mixtral")


def build(kind: str, dtype: torch.dtype = torch.float32, checkpointing: str = "none") -> nn.Module:
    """The model of `kind` from seed 0, in training mode; `checkpointing` "reentrant" or "nonreentrant"
    turns on torch.utils.checkpoint per block (Hugging Face's gradient checkpointing)."""
    torch.manual_seed(0)
    if kind == "sequential":
        m: nn.Module = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64),
                                     nn.LayerNorm(64), nn.Linear(64, 32), nn.Linear(32, VOCAB))
        return m.to(dtype).train()
    import transformers as tf

    if kind == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB,
                                             n_positions=64))
    elif kind == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=160,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                               max_position_embeddings=64))
    else:
        m = tf.MixtralForCausalLM(tf.MixtralConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=96,
                                                   num_attention_heads=4, num_key_value_heads=2,
                                                   vocab_size=VOCAB, max_position_embeddings=64,
                                                   num_local_experts=4, num_experts_per_tok=2))
    m = m.to(dtype)
    m.config.use_cache = False
    if checkpointing != "none":
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return m.train()


def units_of(kind: str, m: nn.Module) -> Any:
    """The units offload_parameters is given: the blocks (None) for the Hugging Face models."""
    return [m[1], m[3], m[4], m[5]] if kind == "sequential" else None


def loss(kind: str, m: nn.Module, step: int, micro: int) -> torch.Tensor:
    """The loss of a seeded batch (its dropout seeded too)."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step * 100 + micro))
    torch.manual_seed(step * 100 + micro)
    if kind == "sequential":
        return nn.functional.cross_entropy(m(ids).float().view(-1, VOCAB), ids.view(-1))
    return m(input_ids=ids, labels=ids).loss


def train(kind: str, m: nn.Module, opt: Any, steps: int, accumulate: int = 1,
          set_to_none: bool = True, start: int = 0) -> list[torch.Tensor]:
    """`steps` optimizer steps (from step `start`) of `accumulate` micro-batches each; the losses."""
    out = []
    for s in range(start, start + steps):
        for k in range(accumulate):
            la = loss(kind, m, s, k)
            (la / accumulate).backward()
            out.append(la.detach())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return out
