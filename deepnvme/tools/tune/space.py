"""The search space of ds_nvme_tune: aio_handle's settings, DeepSpeed's sweep_config names, the plan."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from deepnvme._core.handles import RECOMMENDED
from deepnvme.tools.cli import UsageError
from deepnvme.tools.sizes import parse_size

__all__ = ["ALIASES", "COARSE", "FINE", "KEYS", "START", "Plan", "deepspeed_section", "parse_sweep", "plan",
           "product"]

KEYS = ("block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism", "engine")
# The search starts from the library's recommended settings with one thread, so that the first steps tell
# what more threads are worth on this drive.
START = {**RECOMMENDED, "intra_op_parallelism": 1, "engine": "auto"}
COARSE = {"block_size": [256 << 10, 1 << 20, 4 << 20], "queue_depth": [8, 32, 128],
          "intra_op_parallelism": [1, 2, 4, 8], "overlap_events": [True, False],
          "single_submit": [False, True]}
# DeepSpeed's sweep_config names, mapped to aio_handle's; sequential_requests is the inverse of overlap.
ALIASES = {"io_parallel": "intra_op_parallelism", "num_threads": "intra_op_parallelism"}
FINE = {"block_size": [128 << 10, 512 << 10, 2 << 20, 8 << 20], "queue_depth": [4, 16, 64, 256]}
# Spaces of at most this many points are measured exhaustively.
EXHAUSTIVE_MAX = 12


def _bool(value: Any, key: str) -> bool:
    """JSON booleans, or DeepSpeed's "true"/"false" strings, as bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise UsageError(f"argument --sweep_config: {key} value {value!r} is not a boolean")


def parse_sweep(text: str, engines: list[str]) -> dict[str, list]:
    """--sweep_config (file or inline JSON) -> {aio_handle key: [values]}; UsageError naming what is wrong."""
    try:
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                raw = json.load(f)
        else:
            raw = json.loads(text)
    except (OSError, ValueError) as exc:
        raise UsageError(f"argument --sweep_config: not a JSON file or JSON text ({exc})") from None
    if not isinstance(raw, dict):
        raise UsageError("argument --sweep_config: must be a JSON object of option -> list of values")
    space: dict[str, list] = {}
    for key, values in raw.items():
        if key == "folder_to_device_mapping":
            continue  # DeepSpeed puts the directories here; ours come from --nvme_dir
        values = values if isinstance(values, list) else [values]
        if not values:
            raise UsageError(f"argument --sweep_config: {key} has no values")
        name = ALIASES.get(key, key)
        try:
            if key == "sequential_requests":
                name, vals = "overlap_events", [not _bool(v, key) for v in values]
            elif name in ("single_submit", "overlap_events"):
                vals = [_bool(v, key) for v in values]
            elif name == "block_size":
                vals = [parse_size(v) for v in values]
            elif name in ("queue_depth", "intra_op_parallelism"):
                vals = [int(v) for v in values]
                if min(vals) < 1:
                    raise ValueError("must be at least 1")
            elif name == "engine":
                vals = [str(v) for v in values]
                bad = [v for v in vals if v not in engines]
                if bad:
                    raise ValueError(f"{bad} not available here (available: {engines})")
            else:
                raise UsageError(f"argument --sweep_config: unknown option {key!r} (use one of "
                                 f"{', '.join(KEYS)}, sequential_requests, io_parallel)")
        except (TypeError, ValueError) as exc:
            raise UsageError(f"argument --sweep_config: {key}: {exc}") from None
        space[name] = sorted(set(vals), key=vals.index)
    return space


def product(space: dict[str, list]) -> int:
    """Points in a space."""
    n = 1
    for v in space.values():
        n *= len(v)
    return n


@dataclass
class Plan:
    """What to search: the coarse space, whether to walk all of it, and the fine stage's values."""

    space: dict[str, list]
    exhaustive: bool
    fine: dict[str, list] = field(default_factory=dict)


def plan(sweep_config: str | None, engines: list[str], available: list[str], engine_arg: str) -> Plan:
    """The search for these engines: DeepSpeed's --sweep_config when given, else coarse-to-fine."""
    if sweep_config:
        space = parse_sweep(sweep_config, available)
        space.setdefault("engine", engines if engine_arg != "auto" else [engines[0]])
        return Plan(space, product(space) <= EXHAUSTIVE_MAX)
    fine = {k: sorted(set(v) | set(COARSE[k])) for k, v in FINE.items()}
    return Plan({"engine": engines, **COARSE}, False, fine)


def deepspeed_section(config: dict, gds: bool) -> dict:
    """DeepSpeed's "aio" config section: its key names, JSON booleans, no engine (it has none)."""
    section = {k: config[k] for k in ("block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                                      "overlap_events")}
    if gds:
        section["use_gds"] = True
    return {"aio": section}
