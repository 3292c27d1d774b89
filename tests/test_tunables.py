"""Tunables: one Python table (op_builder/tunables.py), the C++ list that mirrors it, and the env vars."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme import defaults
from op_builder import tunables

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_cpp_list_mirrors_the_python_table():
    """csrc/aio/tunables.h lists the same names, variables and rules as op_builder/tunables.py."""
    text = (REPO_ROOT / "csrc/aio/tunables.h").read_text().replace("\\\n", " ")
    rows = re.findall(r"DNV_TUNABLE\((\w+),\s*\"(\w+)\",\s*(\w+),\s*(\d+),\s*(\d+)\)", text)
    assert [(n, env, d, int(m), int(lo)) for n, env, d, m, lo in rows] == \
        [(t.name, t.env, t.define, t.multiple_of, t.minimum) for t in tunables.TUNABLES]


def test_getters_read_the_environment(monkeypatch):
    """Default when unset; the variable's value (with K/M/G) when set; ValueError naming it when bad."""
    for t in tunables.TUNABLES:
        monkeypatch.delenv(t.env, raising=False)
        assert defaults.get(t.name) == t.default
        assert defaults.describe()[t.name]["env"] == t.env and defaults.describe()[t.name]["doc"]
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFER_BYTES", "256K")
    assert defaults.staging_buffer_bytes() == 256 << 10
    for bad in ("abc", "0", "1000", "-4096", "4096X"):
        monkeypatch.setenv("DEEPNVME_STAGING_BUFFER_BYTES", bad)
        with pytest.raises(ValueError, match="DEEPNVME_STAGING_BUFFER_BYTES"):
            defaults.staging_buffer_bytes()


def test_the_core_reads_every_variable(aio_module, tmp_path):
    """Each malformed variable fails aio_handle() with a ValueError naming it (the core reads that exact
    name); then small valid values still move an unaligned, staged tensor correctly."""
    code = f"""
import os, torch
from op_builder import AsyncIOBuilder, tunables
m = AsyncIOBuilder().load()
for t in tunables.TUNABLES:
    os.environ[t.env] = "12x"
    try:
        m.aio_handle()
    except ValueError as exc:
        assert t.env in str(exc), exc
    else:
        raise SystemExit(f"{{t.env}}=12x was accepted")
    del os.environ[t.env]
os.environ.update(DEEPNVME_STAGING_BUFFER_BYTES="8K", DEEPNVME_STAGING_BUFFERS="4",
                  DEEPNVME_WORKER_STAGING_BYTES="16K", DEEPNVME_MIN_SLICE_BYTES="4K")
h = m.aio_handle(block_size=65536, intra_op_parallelism=2)
data = torch.randint(0, 256, (300001,), dtype=torch.uint8)
src = torch.empty(300002, dtype=torch.uint8)[1:]  # unaligned: goes through the small staging pool
src.copy_(data)
path = {str(tmp_path / "t.bin")!r}
assert h.sync_pwrite(src, path) == 1
back = torch.empty(300002, dtype=torch.uint8)[1:]
assert h.sync_pread(back, path) == 1
assert torch.equal(back, data)
print("OK")
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("DEEPNVME_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
