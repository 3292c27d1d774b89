"""dcp_save / dcp_load: training offloaded by offload_shards saved and resumed through
torch.distributed.checkpoint (gloo, 2 and 4 processes), and resharded 2 -> 4 and 4 -> 2.

Every run trains a tiny Llama from one seed on batches fixed by (rank, step). A checkpoint is taken half
way; the runs resumed from it must continue, bit for bit (losses and final shards), as the run that never
stopped. Across world sizes the reference is FSDP2 in memory on the new ranks loading the same checkpoint
with torch's own set_state_dict: the offloaded run resumed from it must equal that one. The checkpoints
are also crossed: torch's own (FileSystemWriter, from FSDP2 in memory) resumes offloaded, and deepnvme's
resumes in memory. One rank's failure (its swap file damaged) ends the save on both ranks with the same
error, naming that rank and its file, and leaves no checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import launch

from deepnvme.offload import OffloadedOptimizer, dcp_load, dcp_save, offload_shards
from tests.offload.fsdp_models import VOCAB, sharded

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")

STEPS, HALF = 8, 4
DEADLINE_S = 300


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1000 * rank + step))


def _stock_load(m: Any, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _stock_save(m: Any, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _run(rank: int, swap: str, *, offload: bool, bf16: bool = False, load: str | None = None,
         save: str | None = None, torch_made: bool = False) -> dict[str, Any]:
    """Train from step 0 (saving at HALF to `save`), or from `load` at HALF, to STEPS; `torch_made`: the
    checkpoint loaded holds only what torch's code saves (no step beside it)."""
    m = sharded("llama", bf16=bf16)
    shards = offload_shards(m, swap, 4 << 20) if offload else None
    opt: Any = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    if offload:
        opt = OffloadedOptimizer(opt, swap, 1 << 20)
    first = 0
    if load is not None:
        if offload and torch_made:
            assert dcp_load(load, m, opt) == {}
            first = HALF
        elif offload:
            first = dcp_load(load, m, opt, extra={"step": -1})["step"]
        else:
            _stock_load(m, opt, load)
            first = HALF
    losses = []
    for step in range(first, STEPS):
        if step == HALF and save is not None:
            if offload:
                dcp_save(save, m, opt, extra={"step": step})
            else:
                _stock_save(m, opt, save)
        ids = _batch(rank, step)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "shards": [p.to_local().detach().clone() for p in m.parameters()]}
    if shards is not None:
        shards.close()
        opt.close()
    return out


def _one_rank_fails(rank: int, swap: str, folder: str) -> list[str]:
    """Rank 1's swap file damaged (found inside DCP's save), then cut short (found before it): dcp_save
    ends on every rank in an OSError naming rank 1 and its file, never waiting on rank 1."""
    m = sharded("llama")
    shards = offload_shards(m, swap, 4 << 20)
    out = []
    try:
        for damage in ("bytes", "truncate"):
            if rank == 1 and damage == "bytes":
                with open(shards.space.file, "r+b") as f:
                    f.write(b"\xff" * 4096)
            if rank == 1 and damage == "truncate":
                os.truncate(shards.space.file, 4096)
            try:
                dcp_save(folder, m)
                out.append("no error")
            except OSError as exc:
                out.append(f"{exc.errno}|{exc.strerror}|{exc.filename}")
    finally:
        shards.close(restore=False)
    return out


def _body(rank: int, world: int, swap: str, runs: dict[str, dict[str, Any]],
          failing: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {name: _run(rank, swap, **kw) for name, kw in runs.items()}
    if failing is not None:
        out["failing"] = _one_rank_fails(rank, swap, failing)
    return out


def _same(per_rank: list[dict[str, Any]], a: str, b: str, tail: bool = False) -> None:
    for rank, res in enumerate(per_rank):
        la = res[a]["losses"][HALF:] if tail else res[a]["losses"]
        assert la == res[b]["losses"], (a, b, rank, la, res[b]["losses"])
        assert all(torch.equal(x, y) for x, y in zip(res[a]["shards"], res[b]["shards"])), (a, b, rank)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp")


def _needs(checkpoints: Path, name: str, maker: str) -> Path:
    """The checkpoints' folder, once `maker` (a test before, in this file's order) left checkpoint `name`."""
    if not (checkpoints / name / ".metadata").exists():
        pytest.skip(f"needs the checkpoint {name} that {maker} saves")
    return checkpoints


def _swap(tmp_path: Path) -> str:
    swap = tmp_path / "swap"
    swap.mkdir()
    return str(swap)


def test_four_ranks_save_and_resume(checkpoints: Path, tmp_path: Path) -> None:
    """4 ranks: the offloaded run equals FSDP2 in memory, its checkpoint resumes it bit for bit."""
    c = checkpoints
    runs = {
        "memory": dict(offload=False, save=str(c / "memory4")),
        "offload": dict(offload=True, save=str(c / "offload4")),
        "resumed": dict(offload=True, load=str(c / "offload4")),
    }
    swap = _swap(tmp_path)
    per_rank = launch(4, _body, (swap, runs), tmp_path, DEADLINE_S)
    _same(per_rank, "memory", "offload")
    _same(per_rank, "memory", "resumed", tail=True)
    assert os.listdir(swap) == []


def test_two_ranks_save_resume_and_reshard_from_four(checkpoints: Path, tmp_path: Path) -> None:
    """2 ranks, fp32 and bf16 compute: resumed bit for bit from its own checkpoint and from torch's;
    torch resumes from deepnvme's; 4 -> 2: resumed offloaded as FSDP2 in memory resumes."""
    c = _needs(checkpoints, "offload4", "test_four_ranks_save_and_resume")
    runs = {
        "memory": dict(offload=False, save=str(c / "memory2")),
        "offload": dict(offload=True, save=str(c / "offload2")),
        "resumed": dict(offload=True, load=str(c / "offload2")),
        "from-torch": dict(offload=True, load=str(c / "memory2"), torch_made=True),
        "torch-from-ours": dict(offload=False, load=str(c / "offload2")),
        "memory-bf16": dict(offload=False, bf16=True, save=str(c / "memory2-bf16")),
        "offload-bf16": dict(offload=True, bf16=True, save=str(c / "offload2-bf16")),
        "resumed-bf16": dict(offload=True, bf16=True, load=str(c / "offload2-bf16")),
        "memory-from-4": dict(offload=False, load=str(c / "offload4")),
        "offload-from-4": dict(offload=True, load=str(c / "offload4")),
    }
    per_rank = launch(2, _body, (_swap(tmp_path), runs, str(c / "failing")), tmp_path, DEADLINE_S)
    _same(per_rank, "memory", "offload")
    for resumed in ("resumed", "from-torch", "torch-from-ours"):
        _same(per_rank, "memory", resumed, tail=True)
    _same(per_rank, "memory-bf16", "offload-bf16")
    _same(per_rank, "memory-bf16", "resumed-bf16", tail=True)
    _same(per_rank, "memory-from-4", "offload-from-4")
    for res in per_rank:  # one rank's EIO: the same error on both, naming the rank and its swap file
        for said in res["failing"]:
            errno_, message, filename = said.split("|")
            assert errno_ == "5" and message.startswith("rank 1: ") and filename.endswith("swap.bin"), res
    assert per_rank[0]["failing"] == per_rank[1]["failing"]
    assert not (c / "failing" / ".metadata").exists()


def test_reshard_two_to_four(checkpoints: Path, tmp_path: Path) -> None:
    """2 -> 4: the offloaded run resumed on 4 ranks from the 2-rank checkpoint is FSDP2's in memory."""
    c = _needs(checkpoints, "offload2", "test_two_ranks_save_resume_and_reshard_from_four")
    runs = {
        "memory-from-2": dict(offload=False, load=str(c / "offload2")),
        "offload-from-2": dict(offload=True, load=str(c / "offload2")),
    }
    per_rank = launch(4, _body, (_swap(tmp_path), runs), tmp_path, DEADLINE_S)
    _same(per_rank, "memory-from-2", "offload-from-2")
