"""The MoE checkpoint's tags and `latest` stay inside the save directory, `latest` is replaced by the one
atomic recipe (fsynced before its rename), and damaged files are CheckpointFormatErrors naming them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import deepnvme
from deepnvme.moe import checkpoint as ckpt
from deepnvme.moe.recipe.gpt import GPT, GPTConfig


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=12, seq_length=8, num_layers=2, hidden_size=8, num_attention_heads=2,
                         num_experts=2))


@pytest.mark.parametrize("tag", ["..", ".", "/abs", "a/b", "a\0b", ""])
def test_a_tag_outside_the_save_directory_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                tag: str) -> None:
    save = tmp_path / "save"
    save.mkdir()
    with pytest.raises(ValueError, match="inside the checkpoint directory"):
        ckpt.save_moe_checkpoint(_model(), str(save), tag)
    with pytest.raises(ValueError, match="inside the checkpoint directory"):
        ckpt.load_moe_checkpoint(_model(), str(save), tag)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["save"] and not list(save.iterdir())


@pytest.mark.parametrize("latest", ["..", "../elsewhere", "/tmp", ".", "\xff\xfe"])
def test_a_latest_file_pointing_outside_is_a_format_error_naming_it(tmp_path: Path, latest: str) -> None:
    model = _model()
    ckpt.save_moe_checkpoint(model, str(tmp_path), "t")
    path = tmp_path / ckpt.LATEST_FILE
    path.write_bytes(latest.encode("latin-1"))
    for read in (lambda: ckpt.load_moe_checkpoint(model, str(tmp_path)),
                 lambda: ckpt.read_client_state(str(tmp_path))):
        with pytest.raises(deepnvme.CheckpointFormatError) as caught:
            read()
        assert caught.value.filename == str(path)


def test_latest_is_fsynced_before_it_is_renamed_into_place(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src: Any, dst: Any) -> None:
        events.append(("replace", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    ckpt.save_moe_checkpoint(_model(), str(tmp_path), "t")
    latest = str(tmp_path / ckpt.LATEST_FILE)
    renamed = events.index(("replace", latest))
    synced = [i for i, (what, name) in enumerate(events) if what == "fsync" and ".latest." in name]
    assert synced and synced[-1] < renamed
    assert ("fsync", str(tmp_path)) in events[renamed:]  # the directory, after the rename
    assert ckpt.latest_tag(str(tmp_path)) == "t"


def test_an_expert_file_of_another_shape_is_a_format_error(tmp_path: Path) -> None:
    model = _model()
    ckpt.save_moe_checkpoint(model, str(tmp_path), "t")
    expert = tmp_path / "t" / ckpt.expert_file(0, 1)
    deepnvme.save(torch.ones(3), expert)
    with pytest.raises(deepnvme.CheckpointFormatError) as caught:
        ckpt.load_moe_checkpoint(_model(), str(tmp_path))
    assert caught.value.filename == str(expert)
