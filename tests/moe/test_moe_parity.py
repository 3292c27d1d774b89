"""Parity with DeepSpeed's MoE, run in DeepSpeed's own interpreter as a child process.

The interpreter is ``$DEEPNVME_DEEPSPEED_PYTHON``, else ``/work/dsvenv/bin/python`` when it exists;
without one that can import deepspeed the tests skip with the reason. Settings are mostly the deterministic
ones (use_rts=False, no noise, no second-expert sampling); two training cases switch DeepSpeed's random
options on and start both sides from the same RNG state. Both directions are checked: DeepSpeed's state dict
loaded into deepnvme, and deepnvme's (distinct experts) loaded into DeepSpeed; output, l_aux, exp_counts
and all gradients must agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepnvme.moe import MoE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from ds_moe_child import expert, run  # noqa: E402

CHILD = Path(__file__).resolve().parents[1] / "support" / "ds_moe_child.py"
AUX = 0.1
TOL = 1e-5


def _case(k: int, drop: bool, residual: bool = False, train: bool = True, **random: Any) -> dict[str, Any]:
    """One configuration; ``random`` switches on DeepSpeed's random options (default: all off)."""
    moe = {
        "num_experts": 4,
        "k": k,
        "capacity_factor": 0.75,
        "eval_capacity_factor": 0.5,
        "min_capacity": 2,
        "drop_tokens": drop,
        "use_residual": residual,
        "use_rts": False,
        "top2_2nd_expert_sampling": False,
    }
    moe.update(random)
    name = f"k{k}-{'drop' if drop else 'nodrop'}{'-residual' if residual else ''}{'' if train else '-eval'}"
    name += "".join(f"-{key}={value}" for key, value in random.items())
    return {"name": name, "config": {"hidden": 8, "ffn": 16, "gate_scale": 4.0, "train": train, "moe": moe}}


CASES = [
    _case(1, True),
    _case(1, False),
    _case(2, True),
    _case(2, False),
    _case(1, True, residual=True),
    _case(2, True, train=False),
    _case(3, True),
    # Training with DeepSpeed's random options, from the same RNG state: the same samples, so the same routes.
    _case(1, True, use_rts=True, noisy_gate_policy="RSample"),
    _case(2, True, top2_2nd_expert_sampling=True, noisy_gate_policy="Jitter"),
]


def deepspeed_python() -> str | None:
    """The interpreter to run DeepSpeed in, or None."""
    path = os.environ.get("DEEPNVME_DEEPSPEED_PYTHON") or "/work/dsvenv/bin/python"
    return path if Path(path).is_file() and os.access(path, os.X_OK) else None


def ours(case: dict[str, Any], state_dict: dict[str, torch.Tensor] | None = None, seed: int = 123) -> MoE:
    """deepnvme's MoE for a case: with ``state_dict`` loaded, else freshly (and distinctly) initialised."""
    cfg = case["config"]
    torch.manual_seed(seed)
    moe = MoE(cfg["hidden"], expert(cfg["hidden"], cfg["ffn"]), **cfg["moe"])
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.mul_(cfg["gate_scale"])
    if state_dict is not None:
        moe.load_state_dict(state_dict, strict=True)
    return moe.train(cfg["train"])


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One child run covering every case; skips when no DeepSpeed interpreter is usable."""
    python = deepspeed_python()
    if python is None:
        pytest.skip("no DeepSpeed interpreter: set DEEPNVME_DEEPSPEED_PYTHON to a python with deepspeed 0.19")
    probe = subprocess.run(
        [python, "-c", "import deepspeed.moe.layer"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import deepspeed.moe: {probe.stderr.strip().splitlines()[-1:]}")
    work = tmp_path_factory.mktemp("ds_parity")
    torch.manual_seed(7)
    cases = []
    for i, case in enumerate(CASES):
        x = torch.randn(2, 24, case["config"]["hidden"])
        cases.append(
            {
                **case,
                "seed": 1000 + i,
                "x": x,
                "w": torch.randn_like(x),
                "ours_state_dict": ours(case, seed=2000 + i).state_dict(),
            }
        )
    torch.save({"cases": cases, "aux_coeff": AUX}, work / "spec.pt")
    child = subprocess.run(
        [python, str(CHILD), str(work / "spec.pt"), str(work / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if child.returncode != 0:
        raise AssertionError(f"DeepSpeed child failed:\n{child.stderr[-3000:]}")
    out = torch.load(work / "out.pt")
    return {"version": out["version"], "cases": cases, "results": out["results"]}


def max_diffs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Max abs difference per compared quantity (grads: over all parameters)."""
    assert set(a["grads"]) == set(b["grads"])
    return {
        "out": (a["out"] - b["out"]).abs().max().item(),
        "l_aux": (a["l_aux"] - b["l_aux"]).abs().item(),
        "x_grad": (a["x_grad"] - b["x_grad"]).abs().max().item(),
        "param_grad": max((a["grads"][n] - b["grads"][n]).abs().max().item() for n in a["grads"]),
    }


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_matches_deepspeed(deepspeed_results: dict[str, Any], index: int) -> None:
    assert deepspeed_results["version"].startswith("0.19")
    case = deepspeed_results["cases"][index]
    got = deepspeed_results["results"][index]
    # DeepSpeed's weights in deepnvme's layer
    mine = run(ours(case, got["own"]["state_dict"]), case["x"], case["w"], AUX, case["seed"])
    assert torch.equal(mine["exp_counts"].to(torch.int64), got["own"]["exp_counts"].to(torch.int64))
    diffs = max_diffs(mine, got["own"])
    # deepnvme's weights in DeepSpeed's layer
    back = run(ours(case, case["ours_state_dict"]), case["x"], case["w"], AUX, case["seed"])
    assert torch.equal(back["exp_counts"].to(torch.int64), got["back"]["exp_counts"].to(torch.int64))
    back_diffs = max_diffs(back, got["back"])
    print(f"\n{case['name']}: ds->ours {diffs}  ours->ds {back_diffs}")
    for name, d in {**diffs, **{f"back_{k}": v for k, v in back_diffs.items()}}.items():
        assert d <= TOL, f"{name} differs by {d}"
    if case["config"]["moe"]["drop_tokens"]:
        cfg = case["config"]
        moe = ours(case, got["own"]["state_dict"])
        routes = moe.deepspeed_moe.gate.route(case["x"].reshape(-1, cfg["hidden"]))
        assert bool((routes.slot < 0).any()), "a drop case must actually drop tokens"
