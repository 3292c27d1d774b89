"""OffloadedOptimizer over a model sharded by torch's FSDP2 (`fully_shard`, gloo, 2 and 4 processes).

Each rank trains the same tiny Hugging Face Llama on its own batches twice from one seed: with AdamW in
memory and with AdamW's state on the drive (each rank in its own subdirectory of one swap directory). FSDP2
gives each rank a shard of every parameter (a DTensor); the offloaded optimizer steps the shards, so each
rank's swap holds its share of the state only. Losses, gradient norms and final shards must be equal, bit
for bit: fp32, and with FSDP2's bf16 mixed precision (fp32 shards, bf16 compute); with the gradients
clipped by their global norm, as training scripts do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import launch

from deepnvme.offload import OffloadedOptimizer
from tests.offload.fsdp_models import VOCAB, sharded

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")

STEPS = 20
DEADLINE_S = 300
BUDGET = 256 << 10


def _train(rank: int, bf16: bool, directory: str | None) -> dict[str, Any]:
    m = sharded(bf16=bf16)
    opt: Any = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    if directory is not None:
        opt = OffloadedOptimizer(opt, directory, BUDGET)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    batches = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(2)]  # learnt over the steps
    for step in range(STEPS):
        ids = batches[step % 2]
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).full_tensor().item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    shards = [p.to_local().detach().clone() for p in m.parameters()]
    swapped = 0
    if directory is not None:
        swapped = opt.swap.reserved_bytes
        opt.close()
    return {"losses": losses, "norms": norms, "shards": shards, "swapped": swapped,
            "numel": sum(p.numel() for p in m.parameters()),
            "local_numel": sum(p.to_local().numel() for p in m.parameters())}


def _body(rank: int, world: int, directory: str, modes: list[bool]) -> dict[bool, Any]:
    # The modes run one after another in the same processes: a launch costs more than a run.
    return {bf16: {"memory": _train(rank, bf16, None), "offload": _train(rank, bf16, directory)}
            for bf16 in modes}


@pytest.mark.parametrize(("world", "modes"), [(2, [False, True]), (4, [False])])
def test_fsdp2_training_with_state_on_the_drive_equals_memory(tmp_path: Path, world: int,
                                                              modes: list[bool]) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    per_rank = launch(world, _body, (str(swap), modes), tmp_path, DEADLINE_S)
    for bf16 in modes:
        for rank, res in enumerate(per_rank):
            mem, off = res[bf16]["memory"], res[bf16]["offload"]
            assert off["losses"] == mem["losses"], (bf16, rank)
            assert off["norms"] == mem["norms"], (bf16, rank)
            assert all(torch.equal(a, b) for a, b in zip(mem["shards"], off["shards"])), (bf16, rank)
            # AdamW's two fp32 tensors per element of this rank's shards (whole pages per tensor), not of
            # the whole model.
            assert 2 * 4 * off["local_numel"] <= off["swapped"] < 2 * 4 * off["numel"], (bf16, rank)
        first, second = per_rank[0][bf16]["memory"]["losses"], per_rank[1][bf16]["memory"]["losses"]
        assert first != second  # ranks saw different batches
        assert first[-1] < first[0]  # it trained
    assert os.listdir(swap) == []  # each rank's folder was its own and is gone
