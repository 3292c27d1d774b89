"""deepnvme.moe's experts computed together on a CUDA device: torch's grouped mm (the choice there when it
runs) and segments against the per-expert loop, forward and backward, fp32 and bf16; and one layer's step
time per path, printed (the CUDA figure of bench/moe_bench.py's comparison, without DeepSpeed, which a GPU
machine here does not have)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from deepnvme.moe import MoE
from deepnvme.moe.grouped import _grouped_mm_works, choose

DEV = torch.device("cuda")


def _step(monkeypatch: pytest.MonkeyPatch, impl: str, dtype: torch.dtype, hidden: int = 256, ffn: int = 512,
          tokens: int = 2048, experts: int = 16, k: int = 2, dropless: bool = False) -> dict[str, Any]:
    monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", impl)
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    moe = MoE(hidden, expert, num_experts=experts, k=k, capacity_factor=1.25, min_capacity=4, use_rts=False,
              top2_2nd_expert_sampling=False, dropless=dropless).to(DEV, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, dtype).requires_grad_()
    w = torch.randn(tokens, hidden, generator=gen).to(DEV, dtype)
    out, l_aux, _ = moe(x)
    ((out * w).sum() + 0.01 * l_aux).backward()
    torch.cuda.synchronize()
    return {"out": out.detach().float(), "x": x.grad.float(), "path": moe.deepspeed_moe.last_path,
            "grads": {n: p.grad.float() for n, p in moe.named_parameters()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_paths_equal_the_loop_on_cuda(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    ref = _step(monkeypatch, "loop", dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # TF32 may be on for fp32 products; bf16 roundings
    impls = ["segments"] + (["grouped_mm"] if _grouped_mm_works("cuda", dtype)[0] else [])
    for impl in impls:
        got = _step(monkeypatch, impl, dtype)
        assert got["path"] == f"rows, {impl}"
        assert _rel(got["out"], ref["out"]) <= tol and _rel(got["x"], ref["x"]) <= tol, impl
        for name, g in got["grads"].items():
            assert _rel(g, ref["grads"][name]) <= tol, (impl, name)
    monkeypatch.delenv("DEEPNVME_MOE_EXPERTS")
    print(f"\nchoice on cuda {dtype}: {choose(DEV, dtype)}; grouped mm: {_grouped_mm_works('cuda', dtype)}")


def test_segments_are_the_loop_on_cuda_dropless(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rows, the same cuBLAS calls: the loop's bits."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _step(monkeypatch, "loop", torch.float32, dropless=True)
    got = _step(monkeypatch, "segments", torch.float32, dropless=True)
    assert torch.equal(got["out"], ref["out"]) and torch.equal(got["x"], ref["x"])
    assert all(torch.equal(g, ref["grads"][n]) for n, g in got["grads"].items())


def test_step_time_per_path_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prints the median forward + backward of one layer (1024 wide, 64 experts, k=2, 16384 tokens, bf16)
    per path."""
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    moe = MoE(1024, expert, num_experts=64, k=2, capacity_factor=1.25).to(DEV, torch.bfloat16)
    x = torch.randn(16384, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn_like(x)
    times = {}
    for impl in ("loop", "segments", "grouped_mm", "bmm"):
        if impl == "grouped_mm" and not _grouped_mm_works("cuda", torch.bfloat16)[0]:
            continue
        monkeypatch.setenv("DEEPNVME_MOE_EXPERTS", impl)
        samples = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out, l_aux, _ = moe(x)
            ((out * w).sum() + 0.01 * l_aux).backward()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
            moe.zero_grad(set_to_none=True)
            x.grad = None
        times[impl] = sorted(samples[1:])[2]  # the first warms; median of the rest
    print("\nCUDA MoE layer forward+backward, s: " + ", ".join(f"{k} {v:.4f}" for k, v in times.items()))
    assert times
