"""One rank's failure while training offloaded by offload_shards is the error of every rank (gloo, 2
processes): rank 1's swap file damaged before a forward, before a backward, and its optimizer state
damaged before a step; its I/O failing with ENOSPC part way through a step (the fault engine). Rank 1
catches its error and stays, the worst case for rank 0, which without the agreement waits in FSDP's next
collective until the group's timeout. Each rank must raise an OSError (EIO, ENOSPC) naming rank 1 and
rank 1's file within seconds. A rank refusing offload_shards (its budget too small) is every rank's
ValueError, and the rank that had offloaded has its shards back in memory. A unit with no element on
rank 1 (a head of one output) trains as in memory, and an error inside a step's closure names rank 1,
not the rank whose agreement around the closure saw it second."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import launch

from deepnvme.offload import OffloadedOptimizer, dcp_load, dcp_save, offload_shards
from tests.offload.fsdp_models import VOCAB, sharded

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")

DEADLINE_S = 240
FULL_AT = 43  # rank 1's block operation that fails (_full_disk)


def _damage(path: str) -> None:
    """Bytes changed on the drive under the rank (through the page cache: the checksums catch them)."""
    with open(path, "r+b") as f:
        f.write(b"\xff" * (1 << 20))


def _close(shards: Any, opt: Any) -> None:
    """Close both after a failure (each may raise the error again: the test asserted it already)."""
    for close in (lambda: shards.close(restore=False), opt.close):
        try:
            close()
        except OSError:
            pass


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
        _close(shards, opt)
    return out


def _full_disk(rank: int, swap: str) -> dict[str, Any]:
    """Rank 1's drive full part way through training: the fault engine fails its 43rd block operation (a
    read or a write of the second step, by the order its I/O threads take them) with ENOSPC."""
    if rank == 1:
        os.environ.update(DEEPNVME_ENGINE="fault", DEEPNVME_FAULT=f"enospc@{FULL_AT}")
    try:
        m = sharded("llama")
        shards = offload_shards(m, Path(swap) / "full", 4 << 20)
        opt = OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), Path(swap) / "full", 1 << 20)
    finally:
        os.environ.pop("DEEPNVME_ENGINE", None)
        os.environ.pop("DEEPNVME_FAULT", None)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {"said": "no error", "file": shards.space.file}
    try:
        for step in range(6):
            out["step"] = step
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    except OSError as exc:
        out["said"] = f"{exc.errno}|{exc.strerror}|{exc.filename}"
    finally:
        _close(shards, opt)
    return out


def _in_backward_fails(rank: int, swap: str) -> dict[str, Any]:
    """Stepped in the backward, rank 1's optimizer state damaged before a backward: both ranks raise its
    error, then refuse to step (rank 0 may have stepped units rank 1 did not) until dcp_load restores the
    last checkpoint, after which training goes on."""
    m = sharded("llama")
    shards = offload_shards(m, Path(swap) / "sib", 4 << 20)
    opt = OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), Path(swap) / "sib", 1 << 20,
                             step_in_backward=True)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    checkpoint = Path(swap) / "sib-checkpoint"
    out: dict[str, Any] = {}
    try:
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        dcp_save(checkpoint, m, opt)
        loss = m(input_ids=ids, labels=ids).loss
        if rank == 1:
            _damage(opt.swap.file)
        calls = [("said", loss.backward), ("step", opt.step)]
        # Going on without a load: every backward and step refused alike on both ranks, never a wait.
        calls += [(f"again{i}", lambda: m(input_ids=ids, labels=ids).loss.backward()) for i in range(2)]
        for key, call in calls:
            try:
                call()
                out[key] = "no error"
            except (OSError, RuntimeError) as exc:
                out[key] = f"{type(exc).__name__}|{exc}"
        dcp_load(checkpoint, m, opt)
        opt.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        out["after"] = m(input_ids=ids, labels=ids).loss.item()
    finally:
        _close(shards, opt)
    return out


def _refused(rank: int, swap: str) -> dict[str, Any]:
    m = sharded("llama")
    try:
        offload_shards(m, Path(swap) / "refused", 4 << 20 if rank == 0 else 4096)
        said = "no error"
    except ValueError as exc:
        said = f"{exc} {getattr(exc, '__notes__', [])}"
    refusals = {}  # an optimizer's budget, and an argument of dcp_save, refused on rank 1 only
    adamw = torch.optim.AdamW(m.parameters())
    for key, call in (("optimizer", lambda: OffloadedOptimizer(adamw, Path(swap) / "refused",
                                                               1 << 20 if rank == 0 else 4096)),
                      ("dcp_save", lambda: dcp_save(Path(swap) / "no-checkpoint", m,
                                                    extra={} if rank == 0 else [1]))):
        try:
            call()
            refusals[key] = "no error"
        except (ValueError, TypeError) as exc:
            refusals[key] = f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', [])}"
    refusals["groups"] = sorted({type(p).__name__ for g in adamw.param_groups for p in g["params"]})
    # Rank 0's shards back in memory (no mapping): a forward needs nothing of offload_shards.
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = m(input_ids=ids, labels=ids).loss.item()
    left = [str(p) for p in (Path(swap) / "refused").rglob("*") if p.is_file()]
    return {"said": said, "loss": loss, "left": left, **refusals}


class _Net(torch.nn.Module):
    """Two blocks and a head of one output: the head's shards (a 1 x 16 weight, a bias of 1) hold no
    element on rank 1, which offloads only the blocks, yet agrees with rank 0 on the head's hooks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _uneven(rank: int, swap: str, offload: bool) -> dict[str, Any]:
    from torch.distributed import fsdp

    m = _Net()
    for b in m.blocks:
        fsdp.fully_shard(b)
    fsdp.fully_shard(m.head)
    fsdp.fully_shard(m)
    shards = offload_shards(m, Path(swap) / f"uneven{rank}", 1 << 20) if offload else None
    opt: Any = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if offload:
        opt = OffloadedOptimizer(opt, Path(swap) / f"uneven{rank}", 1 << 20)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {"losses": [], "units": [] if shards is None else [u.name for u in shards.units]}
    for _ in range(3):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())

    def closure() -> torch.Tensor:  # rank 1's shards damaged inside a step's closure: still rank 1's error
        opt.zero_grad()
        if rank == 1 and shards is not None:
            _damage(shards.space.file)
        loss = m(x).square().mean()
        loss.backward()
        return loss

    if shards is not None:
        try:
            opt.step(closure)
            out["closure"] = "no error"
        except OSError as exc:
            out["closure"] = f"{exc.errno}|{exc.strerror}|{exc.filename}"
        out["file"] = shards.space.file
        _close(shards, opt)
    return out


def _body(rank: int, world: int, swap: str) -> dict[str, Any]:
    out: dict[str, Any] = {where: _fails(rank, swap, where) for where in ("forward", "backward", "step")}
    out["refused"] = _refused(rank, swap)
    out["full"] = _full_disk(rank, swap)
    out["in-backward"] = _in_backward_fails(rank, swap)
    out["uneven"] = {"memory": _uneven(rank, swap, False), "offload": _uneven(rank, swap, True)}
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
        assert refused["optimizer"].startswith("ValueError: budget_bytes=4096") and "rank 1" in refused[
            "optimizer"] and refused["groups"] == ["DTensor"], refused  # the caller's optimizer as it was
        assert refused["dcp_save"].startswith("TypeError: extra must be a dict"), refused
    sib = [res["in-backward"] for res in per_rank]
    assert sib[0]["said"] == sib[1]["said"] and sib[0]["said"].startswith("OSError|[Errno 5] rank 1: "), sib
    refused = "RuntimeError|a backward whose units the optimizer steps failed"
    assert all(r["step"].startswith(refused) for r in sib), sib
    assert sib[0]["again0"] == sib[1]["again0"] and sib[0]["again1"] == sib[1]["again1"], sib
    assert "refuses to step until" in sib[0]["again1"], sib
    assert all(r["after"] > 0 for r in sib), sib
    full = [res["full"] for res in per_rank]
    assert full[0]["said"] == full[1]["said"] and full[0]["step"] == full[1]["step"] > 0, full
    errno_, message, filename = full[0]["said"].split("|")
    assert errno_ == "28" and message.startswith("rank 1: No space left on device"), full
    assert filename == full[1]["file"], full
    assert per_rank[0]["uneven"]["offload"]["units"] == ["blocks.0", "blocks.1", "head"]
    assert per_rank[1]["uneven"]["offload"]["units"] == ["blocks.0", "blocks.1"]
    for res in per_rank:
        uneven = res["uneven"]
        assert uneven["offload"]["losses"] == uneven["memory"]["losses"], uneven
        errno_, message, filename = uneven["offload"]["closure"].split("|")
        assert errno_ == "5" and message.startswith("rank 1: ") and not message.startswith("rank 1: rank")
        assert filename == per_rank[1]["uneven"]["offload"]["file"], uneven
