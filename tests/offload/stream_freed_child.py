"""Child of test_stream_memory's freeing test: builds a model in memory (real weights), saves it, streams it
from what it saved, and prints one JSON line with its RSS before and after and what stayed resident.

argv: kind ("gpt2", "mixtral" or "moe_gpt"), a scratch directory, budget bytes. A process of its own, so
that the RSS it reads is this model's and nothing a test beside it allocated.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from torch import nn


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "moe_gpt":
        from deepnvme.moe.recipe.gpt import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=256, seq_length=64, num_layers=4, hidden_size=512, num_attention_heads=8,
                        num_experts=(8,), expert_interval=1, topk=2)
        return GPT(cfg, seed=0).eval()
    import transformers as tf

    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
            bos_token_id=0, eos_token_id=0)).eval()
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=12, n_embd=512, n_head=8, vocab_size=256, n_positions=64,
                                            bos_token_id=0, eos_token_id=0)).eval()


def main() -> None:
    kind, scratch, budget = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    from deepnvme.offload import stats, stream_weights, write_store

    model = build(kind)
    store = write_store(model, scratch / "store")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        want = model(ids)[0]
    # Each tensor once: tied weights share memory (GPT-2's head is its embedding).
    total = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
    gc.collect()
    before = rss()
    stream_weights(model, store, budget)
    gc.collect()
    after = rss()
    with torch.inference_mode():
        got = model(ids)[0]
    s = stats(model)
    print(json.dumps({"before": before, "after": after, "total": total, "resident": s["resident_bytes"],
                      "budget": budget, "streamed": s["streamed_bytes"] + s.get("experts", {}).get(
                          "expert_bytes", 0), "equal": bool(torch.equal(want, got))}))


if __name__ == "__main__":
    main()
