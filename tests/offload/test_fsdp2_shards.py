"""offload_shards: each rank's FSDP2 shards (parameters and gradients) on its drive between uses, with
AdamW's state beside them (gloo, 2 processes).

Each rank trains a tiny Hugging Face model on its own batches twice from one seed: FSDP2 in memory, and
FSDP2 with its shards offloaded and AdamW offloaded. Losses and final shards must be equal, bit for bit,
with gradient accumulation, activation checkpointing, bf16 compute, and with the gradients clipped by
their norm between backward and step (torch's clip_grad_norm_ reading and writing the offloaded gradients
through their mappings).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import launch

from deepnvme.offload import OffloadedOptimizer, offload_shards
from tests.offload.fsdp_models import VOCAB, build, sharded

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")

STEPS = 20
DEADLINE_S = 300


def _train(rank: int, case: dict[str, Any], directory: str | None) -> dict[str, Any]:
    checkpoint = case.get("checkpoint") if directory is not None else None
    m = sharded(case["arch"], bf16=case["bf16"], checkpointing=case["checkpointing"],
                meta=checkpoint is not None)
    shards = None
    if directory is not None:
        shards = offload_shards(m, directory, 4 << 20, checkpoint=checkpoint)
    opt: Any = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    if directory is not None:
        opt = OffloadedOptimizer(opt, directory, 1 << 20, step_in_backward=case.get("in_backward", False))
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    resident_after_step = []
    batches = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(2 * case["accumulate"])]
    for step in range(STEPS):
        for k in range(case["accumulate"]):
            if directory is not None and case.get("in_backward"):  # the last micro-batch steps
                opt.step_in_backward = k == case["accumulate"] - 1
            ids = batches[(step * case["accumulate"] + k) % len(batches)]
            loss = m(input_ids=ids, labels=ids).loss
            (loss / case["accumulate"]).backward()
            losses.append(loss.item())
        if case["clip"]:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if shards is not None:
            resident_after_step.append(sum(u.data.nbytes for u in shards.units if u.data.resident))
    out: dict[str, Any] = {"losses": losses, "resident": resident_after_step}
    if shards is not None:
        out["stats"] = shards.stats()
        shards.close()
        opt.close()
    out["shards"] = [p.to_local().detach().clone() for p in m.parameters()]
    return out


def _body(rank: int, world: int, directory: str, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    # The cases run one after another in the same processes: a launch costs more than a case.
    return {name: {"memory": _train(rank, case, None), "offload": _train(rank, case, directory)}
            for name, case in cases.items()}


CASES = {
    "llama": dict(arch="llama", bf16=False, checkpointing=False, accumulate=1, clip=False),
    "llama-clip-accumulate": dict(arch="llama", bf16=False, checkpointing=False, accumulate=2, clip=True),
    "llama-checkpointing-bf16": dict(arch="llama", bf16=True, checkpointing=True, accumulate=1, clip=False),
    "mixtral-accumulate-checkpointing": dict(arch="mixtral", bf16=False, checkpointing=True, accumulate=2,
                                             clip=False),
    # The optimizer stepped in each unit's backward (its gradients never written), with accumulation and
    # activation checkpointing, and with bf16 compute.
    "llama-in-backward-accumulate": dict(arch="llama", bf16=False, checkpointing=True, accumulate=2,
                                         clip=False, in_backward=True),
    "mixtral-in-backward-bf16": dict(arch="mixtral", bf16=True, checkpointing=False, accumulate=1,
                                     clip=False, in_backward=True),
}


def _check(per_rank: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    for rank, res in enumerate(per_rank):
        mem, off = res[name]["memory"], res[name]["offload"]
        assert off["losses"] == mem["losses"], (name, rank, off["losses"][:3], mem["losses"][:3])
        assert all(torch.equal(a, b) for a, b in zip(mem["shards"], off["shards"])), (name, rank)
        assert off["resident"] == [0] * STEPS, (name, rank)  # every shard's memory given back each step
        stats = off["stats"]
        assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0, (name, stats)
        # Only clipping reads the gradients outside a unit's use (through their mappings).
        assert (stats["read_from_mapping"] > 0) == bool(case.get("clip")), (name, stats)
    assert per_rank[0][name]["memory"]["losses"] != per_rank[1][name]["memory"]["losses"], name
    assert per_rank[0][name]["memory"]["losses"][-1] < per_rank[0][name]["memory"]["losses"][0], name


def test_offloaded_shards_train_as_fsdp2_in_memory(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    per_rank = launch(2, _body, (str(swap), CASES), tmp_path, DEADLINE_S)
    for name, case in CASES.items():
        _check(per_rank, name, case)
    for res in per_rank:  # stepped in the backward, the last micro-batch's gradients are never written
        sib, plain = res["llama-in-backward-accumulate"]["offload"], res["llama-clip-accumulate"]["offload"]
        assert sib["stats"]["bytes_written"] < plain["stats"]["bytes_written"], (sib["stats"], plain["stats"])
    assert os.listdir(swap) == []


def test_a_meta_model_filled_from_a_checkpoint_trains_as_in_memory(tmp_path: Path) -> None:
    """Built on the meta device, sharded, its shards made from a checkpoint a unit at a time (each rank
    reading its rows; 97 vocabulary rows shard unevenly, 49 and 48): the same training as the model built
    in memory, from a safetensors file, a torch-format file and deepnvme's store."""
    pytest.importorskip("accelerate")
    from safetensors.torch import save_file

    import deepnvme
    from deepnvme.offload import write_store

    sd = build("llama").state_dict()
    save_file(sd, tmp_path / "model.safetensors")
    deepnvme.save(sd, tmp_path / "model.pt")
    paths = {"safetensors": str(tmp_path / "model.safetensors"), "torch": str(tmp_path / "model.pt"),
             "store": write_store(build("llama"), tmp_path / "store")}
    swap = tmp_path / "swap"
    swap.mkdir()
    cases = {kind: dict(CASES["llama"], checkpoint=path) for kind, path in paths.items()}
    per_rank = launch(2, _body, (str(swap), cases), tmp_path, DEADLINE_S)
    for name, case in cases.items():
        _check(per_rank, name, case)
