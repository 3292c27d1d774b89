"""Whose tool is running: the first line of every run, the field in its JSON, and the way to DeepSpeed's twin.

deepnvme and DeepSpeed both install ``ds_report``, ``ds_io`` and ``ds_nvme_tune``; whichever package pip
installed last owns those names (see the README, "Beside DeepSpeed"). So every run of ours says that it is
deepnvme's, and when DeepSpeed is importable, how to run DeepSpeed's tool of the same name whatever owns it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from deepnvme._version import __version__

__all__ = ["DEEPSPEED_TWINS", "banner", "deepspeed_importable", "identity"]

# How DeepSpeed 0.19.8's tools run without their console scripts. Its ds_nvme_tune has no module of its own
# to run (deepspeed.nvme.perf_run_sweep's __main__ calls sweep_main() without arguments), so the command is
# its script's three lines; argparse reads the arguments that follow it as usual.
DEEPSPEED_TWINS = {
    "ds_report": "python -m deepspeed.env_report",
    "ds_io": "python -m deepspeed.nvme.test_ds_aio",
    "ds_nvme_tune": 'python -c "from deepspeed.nvme import sweep_main, generate_main, parse_sweep_arguments; '
                    'a = parse_sweep_arguments(); sweep_main(a); generate_main(a.log_dir)"',
}


def deepspeed_importable() -> bool:
    """Whether ``import deepspeed`` would find a package, without importing it (that takes seconds)."""
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # a broken entry on sys.path, or a half-removed install
        return False


def _twin(shared_name: str | None) -> str | None:
    """The command that runs DeepSpeed's tool of that name, when DeepSpeed is importable."""
    if shared_name not in DEEPSPEED_TWINS or not deepspeed_importable():
        return None
    return DEEPSPEED_TWINS[shared_name]


def identity(prog: str, shared_name: str | None) -> dict[str, Any]:
    """The JSON field: this run's command, the package it belongs to, and DeepSpeed's twin (None without)."""
    return {"command": prog, "package": "deepnvme", "version": __version__,
            "deepspeed_command": _twin(shared_name)}


def banner(prog: str, shared_name: str | None) -> str:
    """The first line of a run, e.g. ``ds_report (deepnvme 0.1.0); DeepSpeed's ds_report: python -m ...``."""
    line = f"{prog} (deepnvme {__version__})"
    twin = _twin(shared_name)
    return f"{line}; DeepSpeed's {shared_name}: {twin}" if twin else line
