"""The module paths deepnvme.offload had before its floors still import for a release, each with a
DeprecationWarning naming its new module, and give the same objects as the new paths."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import deepnvme.offload
from deepnvme.offload import _moved

ROOT = Path(__file__).resolve().parents[2]

# Names each old path was imported for, and where they live now.
SAMPLES = {
    "bulk": ("load_safetensors", "deepnvme.offload.infer"),
    "closing": ("Closing", "deepnvme.offload.swap"),
    "expert_cache": ("ExpertCache", "deepnvme.offload.experts"),
    "expert_sets": ("find_expert_sets", "deepnvme.offload.experts"),
    "expert_stream": ("split_budget", "deepnvme.offload.experts"),
    "model_map": ("unit_names", "deepnvme.offload.model"),
    "optimizer": ("OffloadedOptimizer", "deepnvme.offload.train"),
    "ownstore": ("write_store", "deepnvme.offload.infer"),
    "placeholder": ("Placeholder", "deepnvme.offload.model"),
    "pool": ("BufferPool", "deepnvme.offload.swap"),
    "preflight": ("budget_arg", "deepnvme.offload.swap"),
    "queues": ("Ticket", "deepnvme.offload.swap"),
    "safetensors_store": ("SafetensorsStore", "deepnvme.offload.stores"),
    "store": ("TensorInfo", "deepnvme.offload.stores"),
    "stream": ("stream_weights", "deepnvme.offload.infer"),
    "swapdir": ("own_name", "deepnvme.offload.swap.folders"),
}


def test_every_old_path_is_sampled() -> None:
    assert sorted(SAMPLES) == sorted(_moved.MOVED)


@pytest.mark.parametrize("old", sorted(SAMPLES))
def test_an_old_path_imports_and_warns(old: str) -> None:
    name, home = SAMPLES[old]
    full = f"deepnvme.offload.{old}"
    sys.modules.pop(full, None)  # imported by an earlier test: it warns on its first import only
    with pytest.warns(DeprecationWarning, match=rf"{full} is deprecated: import from "
                                                 rf"deepnvme\.offload\.{_moved.MOVED[old][0]}") as caught:
        module = importlib.import_module(full)
    assert caught[0].filename == __file__  # the warning points at the importing line
    assert getattr(module, name) is getattr(importlib.import_module(home), name)
    assert name in module.__all__


def test_old_private_names_that_were_used_outside_still_resolve() -> None:
    sys.modules.pop("deepnvme.offload.stream", None)
    with pytest.warns(DeprecationWarning):
        from deepnvme.offload.stream import _ATTR
    from deepnvme.offload.infer.running import STREAM_ATTR

    assert _ATTR == STREAM_ATTR


def test_an_old_path_read_as_an_attribute_of_the_package() -> None:
    sys.modules.pop("deepnvme.offload.store", None)
    vars(deepnvme.offload).pop("store", None)  # an earlier import set it
    with pytest.warns(DeprecationWarning, match="deepnvme.offload.store is deprecated"):
        store = deepnvme.offload.store
    assert store.StoreError is deepnvme.offload.StoreError
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        deepnvme.offload.nothing_here  # noqa: B018


def test_the_new_paths_do_not_warn() -> None:
    """The floors and the package face import without a DeprecationWarning (what the repo itself uses)."""
    code = ("import warnings\n"
            "warnings.filterwarnings('error', 'deepnvme', DeprecationWarning)\n"
            "import deepnvme.offload, deepnvme.offload.swap, deepnvme.offload.stores\n"
            "import deepnvme.offload.model, deepnvme.offload.experts, deepnvme.offload.train\n"
            "import deepnvme.offload.infer\n"
            "from deepnvme.offload.swap import folders, preflight\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
