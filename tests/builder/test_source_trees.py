"""Two source trees (checkouts, worktrees, installs) of the same op share one cache folder without building
over each other: each keeps its own build folder, so loading one never sends the other to a rebuild."""

from __future__ import annotations

from pathlib import Path

import pytest
from builder_helpers import load_script, run_python, tiny_build_dir, write_plugin

pytest.importorskip("torch")

LOAD = load_script("tiny_trees")


def test_two_trees_sharing_a_cache_stay_warm(tmp_path):
    one, two, ext = tmp_path / "one", tmp_path / "two", tmp_path / "ext"
    write_plugin(one, name="tiny_trees", value=1)
    write_plugin(two, name="tiny_trees", value=2)
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    first = run_python(LOAD, paths=[one], env=env)
    second = run_python(LOAD, paths=[two], env=env)
    assert (first["result"]["value"], second["result"]["value"]) == (1, 2)
    for root, value in ((one, 1), (two, 2)):
        again = run_python(LOAD, paths=[root], env=env)
        assert again["result"]["value"] == value
        assert again["result"]["warm_miss"] is None and again["calls"] == [], again["result"]["warm_miss"]
    assert Path(first["result"]["file"]).parent == tiny_build_dir(ext, one, "tiny_trees")
    assert Path(second["result"]["file"]).parent == tiny_build_dir(ext, two, "tiny_trees")
    assert tiny_build_dir(ext, one, "tiny_trees") != tiny_build_dir(ext, two, "tiny_trees")
