"""The handle checkpoints use when none is given: CHECKPOINT's settings, or a drive's tuned ones from a file
in the checkpoint's directory (or the one above) or from the file DEEPNVME_HANDLE_CONFIG names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import deepnvme
from deepnvme._core import handles
from deepnvme._core.handles import CHECKPOINT, TUNED_ENV, TUNED_FILE, checkpoint_handle, checkpoint_settings
from deepnvme.checkpoint import AioStorageReader, AioStorageWriter

TUNED = {"block_size": 2 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
         "intra_op_parallelism": 1, "engine": "auto"}


@pytest.fixture(autouse=True)
def no_process_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without a process-wide tuned file (the developer's shell may set one)."""
    monkeypatch.delenv(TUNED_ENV, raising=False)


def settings_of(h: Any) -> dict[str, Any]:
    return {"block_size": h.get_block_size(), "queue_depth": h.get_queue_depth(),
            "intra_op_parallelism": h.get_intra_op_parallelism()}


def used_by_last_checkpoint(slot: int = 0) -> dict[str, Any]:
    """The settings of this thread's checkpoint handle in `slot`: the one the last save/load made or kept."""
    return settings_of(handles._thread_handles()[("checkpoint", slot)][1])


def expect(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: settings[k] for k in ("block_size", "queue_depth", "intra_op_parallelism")}


def test_built_in_default_is_for_large_sequential_transfers(tmp_path: Path) -> None:
    settings, source = checkpoint_settings(tmp_path)
    assert (settings, source) == (CHECKPOINT, "built-in")
    assert CHECKPOINT["block_size"] >= 8 << 20 and CHECKPOINT["queue_depth"] >= 32
    deepnvme.save({"w": torch.arange(1 << 18, dtype=torch.float32)}, tmp_path / "a.pt")
    assert used_by_last_checkpoint() == expect(CHECKPOINT)


def test_tuned_file_in_the_directory_is_picked_up_by_save_and_load(tmp_path: Path) -> None:
    (tmp_path / TUNED_FILE).write_text(json.dumps(TUNED))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    checkpoint_handle(elsewhere)  # this thread's slot 0 now holds the built-in settings
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    deepnvme.save(state, tmp_path / "a.pt")
    assert used_by_last_checkpoint() == expect(TUNED)
    checkpoint_handle(elsewhere)
    checkpoint_handle(elsewhere, 1)
    assert torch.equal(deepnvme.load(tmp_path / "a.pt")["w"], state["w"])
    assert used_by_last_checkpoint(0) == used_by_last_checkpoint(1) == expect(TUNED)


def test_parent_directory_file_and_ds_nvme_tune_record(tmp_path: Path) -> None:
    # ds_nvme_tune --json prints a record with the settings under "config"; either form is accepted
    (tmp_path / TUNED_FILE).write_text(json.dumps({"config": TUNED, "read_gb_s": 3.1}))
    step = tmp_path / "step100"
    step.mkdir()
    settings, source = checkpoint_settings(step)
    assert source == str(tmp_path / TUNED_FILE)
    assert expect(settings) == expect(TUNED)
    assert settings_of(AioStorageWriter(step).handle) == expect(TUNED)
    assert settings_of(AioStorageReader(step).handle) == expect(TUNED)


def test_process_setting_and_its_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tuned = tmp_path / "best_config.json"
    tuned.write_text(json.dumps({"block_size": 4 << 20, "queue_depth": 64}))  # the rest: CHECKPOINT's
    monkeypatch.setenv(TUNED_ENV, str(tuned))
    data = tmp_path / "data"
    data.mkdir()
    settings, source = checkpoint_settings(data)
    assert source == str(tuned)
    assert settings == {**CHECKPOINT, "block_size": 4 << 20, "queue_depth": 64}
    deepnvme.save({"w": torch.ones(1000)}, data / "a.pt")
    assert used_by_last_checkpoint() == expect(settings)
    # a directory's own file is more specific than the process's
    (data / TUNED_FILE).write_text(json.dumps(TUNED))
    assert checkpoint_settings(data)[1] == str(data / TUNED_FILE)


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"block_size": 0}), "block_size"),
    (json.dumps({"queue_depth": "32"}), "queue_depth"),
    (json.dumps({"blocksize": 1 << 20}), "blocksize"),
])
def test_a_bad_tuned_file_fails_the_save_naming_it(tmp_path: Path, content: str, problem: str) -> None:
    bad = tmp_path / TUNED_FILE
    bad.write_text(content)
    with pytest.raises(ValueError, match=problem) as caught:
        deepnvme.save({"w": torch.ones(10)}, tmp_path / "a.pt")
    assert str(bad) in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [TUNED_FILE]  # nothing written


def test_process_setting_naming_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TUNED_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=TUNED_ENV):
        checkpoint_settings(tmp_path)
