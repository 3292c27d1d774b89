"""One rank's failure while training offloaded by offload_shards is the error of every rank (gloo, 2
processes): rank 1's swap file damaged before a forward, before a backward, and its optimizer state
damaged before a step; rank 1 catches its error and stays, the worst case for rank 0, which without the
agreement waits in FSDP's next collective until the group's timeout. Each rank must raise an OSError
(EIO) naming rank 1 and rank 1's file within seconds. A rank refusing offload_shards (its budget too
small) is every rank's ValueError, and the rank that had offloaded has its shards back in memory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import launch

from deepnvme.offload import OffloadedOptimizer, offload_shards
from tests.offload.fsdp_models import VOCAB, sharded

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")

DEADLINE_S = 240


def _damage(path: str) -> None:
    """Bytes changed on the drive under the rank (through the page cache: the checksums catch them)."""
    with open(path, "r+b") as f:
        f.write(b"\xff" * (1 << 20))


def _fails(rank: int, swap: str, where: str) -> dict[str, Any]:
    m = sharded("llama")
    shards = offload_shards(m, Path(swap) / where, 4 << 20)
    opt = OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), Path(swap) / where, 1 << 20)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    try:
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        began = time.monotonic()
        try:
            if rank == 1 and where == "forward":
                _damage(shards.space.file)
            loss = m(input_ids=ids, labels=ids).loss
            if rank == 1 and where == "backward":
                _damage(shards.space.file)
            loss.backward()
            if rank == 1 and where == "step":
                _damage(opt.swap.file)
            opt.step()
            out["said"] = "no error"
        except OSError as exc:  # caught, as a script that logs and carries on would
            out["said"] = f"{exc.errno}|{exc.strerror}|{exc.filename}"
        out["seconds"] = time.monotonic() - began
        out["file"] = opt.swap.file if where == "step" else shards.space.file
    finally:
        for close in (lambda: shards.close(restore=False), opt.close):
            try:
                close()
            except OSError:
                pass
    return out


def _refused(rank: int, swap: str) -> dict[str, Any]:
    m = sharded("llama")
    try:
        offload_shards(m, Path(swap) / "refused", 4 << 20 if rank == 0 else 4096)
        said = "no error"
    except ValueError as exc:
        said = f"{exc} {getattr(exc, '__notes__', [])}"
    # Rank 0's shards back in memory (no mapping): a forward needs nothing of offload_shards.
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = m(input_ids=ids, labels=ids).loss.item()
    left = [str(p) for p in (Path(swap) / "refused").rglob("*") if p.is_file()]
    return {"said": said, "loss": loss, "left": left}


def _body(rank: int, world: int, swap: str) -> dict[str, Any]:
    out: dict[str, Any] = {where: _fails(rank, swap, where) for where in ("forward", "backward", "step")}
    out["refused"] = _refused(rank, swap)
    return out


def test_one_ranks_io_error_is_every_ranks(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    per_rank = launch(2, _body, (str(swap),), tmp_path, DEADLINE_S)
    for where in ("forward", "backward", "step"):
        said = [res[where]["said"] for res in per_rank]
        assert said[0] == said[1], (where, said)
        errno_, message, filename = said[0].split("|")
        assert errno_ == "5" and message.startswith("rank 1: "), (where, said)
        assert filename == per_rank[1][where]["file"], (where, said, per_rank[1][where]["file"])
        assert all(res[where]["seconds"] < 30 for res in per_rank), (where, per_rank)
    for res in per_rank:
        refused = res["refused"]
        assert "budget_bytes=4096 is less than offload_shards needs" in refused["said"], refused
        assert "(raised on rank 1)" in refused["said"], refused
        assert refused["left"] == [] and refused["loss"] > 0, refused  # no swap file left behind
