"""Helpers of the weight-streaming tests: a unit's compute held until the read issued ahead for it landed; a
blob of deepnvme's store damaged on the drive."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from thread_helpers import wait_until
from torch import nn


def hold_until_read_ahead(model: nn.Module, units: Iterable[nn.Module]) -> list[Any]:
    """Before each run of `units` (unit modules of the streamed `model`), once the read order is recorded,
    fail at once if the read of the unit's position was not issued ahead, else wait until it has finished.

    Why: a prefetch hit (stats' `hits`) is a read that finished before its unit ran, which a unit's compute
    of microseconds against a read of milliseconds leaves to the scheduler (a loaded machine counted none).
    Held this way every read after the recording forward is a hit, whatever the load, and a read-ahead that
    issues nothing fails the test instead of counting stalls. Returns the hooks' handles (remove() them).
    """
    streamer = model._deepnvme_stream

    def hold(module: nn.Module, _args: Any) -> None:
        reader, order, pos = streamer.reader, streamer.order, streamer.pos
        if reader is None or streamer.units[order[pos % len(order)]].module is not module:
            return  # the recording forward, or a unit out of the order (read on demand: no hit to show)
        if pos not in reader._issued:
            raise AssertionError(f"position {pos} (unit {streamer.units[order[pos % len(order)]].name!r}) "
                                 "was not read ahead")
        wait_until(lambda: reader.ready(pos), f"the read ahead of position {pos}")

    return [u.register_forward_pre_hook(hold) for u in units]


def damage_blob(store: Path, unit: str) -> tuple[Path, Callable[[], None]]:
    """Flip one byte in the middle of `unit`'s blob in the deepnvme store at `store` (a copy: the file is
    changed in place). Returns the store's weights file and a function that puts the byte back."""
    manifest = json.loads((store / "manifest.json").read_text())
    blob = next(b for b in manifest["blobs"] if b["unit"] == unit)
    weights = store / manifest["file"]
    at = blob["offset"] + blob["nbytes"] // 2
    with open(weights, "r+b") as f:
        f.seek(at)
        good = f.read(1)
        f.seek(at)
        f.write(bytes([good[0] ^ 0xFF]))

    def repair() -> None:
        with open(weights, "r+b") as f:
            f.seek(at)
            f.write(good)
    return weights, repair
