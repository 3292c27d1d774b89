"""offload_parameters with checkpoints: a model built without its weights (meta device, or accelerate's
init_empty_weights) filled a tensor at a time from safetensors, deepnvme's store or torch's format; saved
back streamed from the drive; a run resumed from them goes on bit for bit (issue 36)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.offload import OffloadedOptimizer, StoreError, write_store
from deepnvme.offload.train import offload_parameters
from tests.offload.train_models import build, train, units_of

BUDGET = 4 << 20
OPT_BUDGET = 8 << 20


def _empty(kind: str) -> nn.Module:
    """The model of `kind` without weights: on the meta device (sequential), or accelerate's
    init_empty_weights (Hugging Face models: their buffers, not in checkpoints, stay real)."""
    if kind == "sequential":
        with torch.device("meta"):
            return build(kind)
    pytest.importorskip("accelerate", reason="the offload extra (accelerate) is needed")
    from accelerate import init_empty_weights

    with init_empty_weights():
        m = build(kind)
    m.tie_weights()  # transformers ties weights only once they have values; ties make the model's parameters
    return m


def _checkpoint(kind: str, how: str, ref: nn.Module, where: Path) -> Path:
    if how == "safetensors":
        if kind == "sequential":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, where / "model.safetensors")
        else:
            ref.save_pretrained(where, safe_serialization=True, max_shard_size="200KB")
        return where
    if how == "store":
        write_store(ref, where / "store", units=["1", "3", "4", "5"] if kind == "sequential" else None)
        return where / "store"
    path = where / "model.pt"
    (deepnvme.save if how == "deepnvme" else torch.save)(ref.state_dict(), path)
    return path


@pytest.mark.parametrize("how", ["safetensors", "store", "deepnvme", "torch"])
@pytest.mark.parametrize("kind", ["sequential", "llama"])
def test_a_model_without_weights_is_filled_from_a_checkpoint(kind: str, how: str, workdir: Path,
                                                             tmp_path: Path) -> None:
    if kind != "sequential":
        pytest.importorskip("transformers", reason="the offload extra (transformers) is needed")
    ref = build(kind)
    ckpt = _checkpoint(kind, how, ref, tmp_path)
    m = _empty(kind)
    with offload_parameters(m, workdir, BUDGET, units=units_of(kind, m), checkpoint=ckpt) as off, \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET) as opt:
        assert not any(p.is_meta for p in m.parameters())
        want = train(kind, ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 4)
        assert all(torch.equal(a, b) for a, b in zip(want, train(kind, m, opt, 4)))
        assert off.stats()["bytes_written"] > 0
    for a, b in zip(ref.state_dict().values(), m.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["sequential", "gpt2"])
def test_a_run_resumes_from_its_checkpoints_bit_for_bit(kind: str, workdir: Path, tmp_path: Path) -> None:
    """Five steps, save() of the model and of the optimizer, a new process's objects (a model without
    weights filled from the checkpoint), five more: as ten steps in memory."""
    if kind != "sequential":
        pytest.importorskip("transformers", reason="the offload extra (transformers) is needed")
    ref = build(kind)
    want = train(kind, ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 10)
    m = build(kind)
    with offload_parameters(m, workdir, BUDGET, units=units_of(kind, m)) as off, \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET) as opt:
        got = train(kind, m, opt, 5)
        off.save(tmp_path / "model.pt")
        opt.save(tmp_path / "optim.pt")
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved.keys() == m.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in m.state_dict().items())
    m2 = _empty(kind)
    with offload_parameters(m2, workdir, BUDGET, units=units_of(kind, m2),
                            checkpoint=tmp_path / "model.pt"), \
            OffloadedOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-3), workdir, OPT_BUDGET) as opt2:
        opt2.load(tmp_path / "optim.pt")
        got += train(kind, m2, opt2, 5, start=5)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m2.parameters()))


def test_checkpoints_that_do_not_fit_the_model_are_refused_naming_the_tensor(workdir: Path,
                                                                              tmp_path: Path) -> None:
    ref = build("sequential")
    sd = ref.state_dict()
    with pytest.raises(ValueError, match=r"1\.weight is on the meta device: give checkpoint="):
        offload_parameters(_empty("sequential"), workdir, BUDGET, units=["1", "3", "4", "5"])
    torch.save({k: v for k, v in sd.items() if k != "3.weight"}, tmp_path / "missing.pt")
    with pytest.raises(StoreError, match=r"3\.weight is on the meta device and .*missing\.pt does not"):
        offload_parameters(_empty("sequential"), workdir, BUDGET, units=["1", "3", "4", "5"],
                           checkpoint=tmp_path / "missing.pt")
    torch.save({**sd, "3.weight": torch.zeros(3, 3)}, tmp_path / "shape.pt")
    with pytest.raises(StoreError, match=r"3\.weight: \(3, 3\) in .*shape\.pt, \(64, 64\) in the model"):
        offload_parameters(_empty("sequential"), workdir, BUDGET, units=["1", "3", "4", "5"],
                           checkpoint=tmp_path / "shape.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(StoreError, match="junk.pt: not a checkpoint in torch's format"):
        offload_parameters(_empty("sequential"), workdir, BUDGET, units=["1", "3", "4", "5"],
                           checkpoint=tmp_path / "junk.pt")
