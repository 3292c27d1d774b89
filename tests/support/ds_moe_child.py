"""Runs DeepSpeed's MoE for tests/moe/test_moe_parity.py in DeepSpeed's interpreter (not collected).

``python ds_moe_child.py SPEC OUT``: for each case in SPEC (a torch.save'd dict), build DeepSpeed's MoE from
the case's seed and config, run forward+backward on the case's input with its own initial weights, then
load the state dict deepnvme produced for the case and run again. Results go to OUT.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


def expert(hidden: int, ffn: int) -> nn.Module:
    """The expert both sides use (same module names, so the state-dict keys match)."""
    return nn.Sequential(nn.Linear(hidden, ffn), nn.ReLU(), nn.Linear(ffn, hidden))


def run(moe: nn.Module, x: torch.Tensor, w: torch.Tensor, aux_coeff: float, seed: int) -> dict[str, Any]:
    """Forward + backward of ``(out * w).sum() + aux_coeff * l_aux`` from RNG state ``seed`` (the random
    routing options draw from it); everything detached for saving."""
    moe.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    xx = x.clone().requires_grad_(True)
    out, l_aux, counts = moe(xx)
    ((out * w).sum() + aux_coeff * l_aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in moe.named_parameters() if p.grad is not None}
    return {
        "out": out.detach(),
        "l_aux": l_aux.detach(),
        "exp_counts": counts.detach().clone(),
        "x_grad": xx.grad.detach(),
        "grads": grads,
    }


def main(spec_path: str, out_path: str) -> None:
    import deepspeed
    from deepspeed.moe.layer import MoE

    spec = torch.load(spec_path)
    results = []
    for case in spec["cases"]:
        cfg = case["config"]
        torch.manual_seed(case["seed"])
        moe = MoE(cfg["hidden"], expert(cfg["hidden"], cfg["ffn"]), **cfg["moe"])
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.mul_(cfg["gate_scale"])
        moe.train(cfg["train"])
        own = run(moe, case["x"], case["w"], spec["aux_coeff"], case["seed"])
        own["state_dict"] = {k: v.detach().clone() for k, v in moe.state_dict().items()}
        moe.load_state_dict(case["ours_state_dict"], strict=True)
        back = run(moe, case["x"], case["w"], spec["aux_coeff"], case["seed"])
        results.append({"own": own, "back": back})
    torch.save({"version": deepspeed.__version__, "results": results}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
