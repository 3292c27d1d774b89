"""Streamed experts on a CUDA device: a deepnvme.moe GPT (pure torch, no transformers needed) streamed from
deepnvme's store with a budget of a few experts gives the output of the model kept on the device; experts
read into the cache's locked memory are copied to the device as they are used."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from deepnvme.moe.recipe.gpt import GPT, GPTConfig  # noqa: E402
from deepnvme.offload import stats, stream_weights, unstream, write_store  # noqa: E402


def gpt() -> GPT:
    cfg = GPTConfig(vocab_size=96, seq_length=64, num_layers=4, hidden_size=64, num_attention_heads=4,
                    num_experts=(8,), expert_interval=2, topk=2, min_capacity=1)
    return GPT(cfg, seed=0).eval()


def expert_bytes(model: GPT) -> int:
    expert = model.blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts[0]
    return sum(p.numel() * p.element_size() for p in expert.parameters())


def run_streamed_against_in_memory(store: Path, device: str) -> dict:
    """Greedy steps of the streamed model against the in-memory one, both on `device`; the statistics."""
    ref = gpt().to(device)
    model = stream_weights(gpt(), store, 6 * expert_bytes(ref)).to(device)
    idx = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], device=device)
    with torch.inference_mode():
        for _ in range(8):
            want = ref(idx)[0]
            got = model(idx)[0]
            assert got.device.type == torch.device(device).type
            assert torch.equal(got, want)
            idx = torch.cat([idx, want[:, -1].argmax(-1, keepdim=True)], 1)
    s = stats(model)["experts"]
    unstream(model)
    assert all(p.device.type == torch.device(device).type for p in model.parameters())
    with torch.inference_mode():
        assert torch.equal(model(idx)[0], ref(idx)[0])
    return s


def test_streamed_experts_on_cuda(tmp_path: Path) -> None:
    store = Path(write_store(gpt(), tmp_path / "store"))
    s = run_streamed_against_in_memory(store, "cuda")
    assert s["misses"] > 0 and s["evictions"] > 0 and s["capacity_bytes"] < 16 * expert_bytes(gpt())
