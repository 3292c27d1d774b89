"""OffloadedOptimizer with a model on the GPU and its state on the drive: the same optimizer kept on the GPU
in memory gives the same losses and parameters bit for bit (fp32; bf16 with fp32 masters), tile by tile and a
chunk at a time, through save and load. The step runs on the GPU (the state staged through the locked
pool), so the kernels are the in-memory optimizer's own: foreach and fused included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from deepnvme.offload import OffloadedOptimizer  # noqa: E402
from tests.offload.optim_cases import run  # noqa: E402 - seeded batches on the model's device

STEPS = 20
BUDGET = 64 << 10  # 16 KiB tiles: the first weight's state is stepped a chunk at a time

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 97), nn.Tanh(), nn.Linear(97, 3)).to("cuda", dtype)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
def test_gpu_parameters_state_on_the_drive_bit_identical(name: str, dtype: torch.dtype,
                                                          tmp_path: Path) -> None:
    masters = dtype != torch.float32
    ref, off = net(dtype), net(dtype)
    ref_masters = [p.detach().float().clone() for p in ref.parameters()] if masters else None
    ref_opt = OPTIMIZERS[name](ref_masters if masters else ref.parameters())
    with OffloadedOptimizer(OPTIMIZERS[name](off.parameters()), tmp_path / "swap", BUDGET,
                            master_weights=masters) as opt:
        assert run(ref, ref_opt, range(STEPS), ref_masters) == run(off, opt, range(STEPS))
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), off.parameters()))
        assert all(p.device.type == "cuda" for p in off.parameters())
        opt.save(tmp_path / "o.pt")
    with OffloadedOptimizer(OPTIMIZERS[name](off.parameters()), tmp_path / "swap", BUDGET,
                            master_weights=masters) as opt:
        opt.load(tmp_path / "o.pt")
        later = range(STEPS, STEPS + 3)
        assert run(ref, ref_opt, later, ref_masters) == run(off, opt, later)
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), off.parameters()))
