"""Unaligned transfers through a caller's descriptor whose file may no longer be opened by its mode.

The exact rule: a descriptor opened without O_DIRECT is used as it is for the whole request (never
reopened), so an unaligned write through it works whatever the file's mode says now. A descriptor opened
with O_DIRECT cannot carry the unaligned first and last bytes, and its flags are the caller's: the handle
reopens the file through /proc/self/fd for them. Where the file's mode refuses that reopen, the request
raises PermissionError saying to pass a descriptor without O_DIRECT or to align the range; aligned ranges
through that descriptor need no reopen and work.

Run in a child that drops root (root may reopen any file, so the refusal would not happen).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, torch
from deepnvme import AsyncIOBuilder
module = AsyncIOBuilder().load()  # loaded while the build cache is readable
directory = sys.argv[1]
if os.getuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
handle = module.aio_handle(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1)
data = (torch.arange(10000) % 251).to(torch.uint8)
out = {}
for direct in (False, True):
    path = os.path.join(directory, f"direct{int(direct)}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
    os.fchmod(fd, 0o444)  # from now on the file's mode refuses to open it for writing
    try:
        try:
            handle.sync_pwrite(data, fd, 100)
            out[f"unaligned{int(direct)}"] = "ok"
        except OSError as exc:
            out[f"unaligned{int(direct)}"] = [type(exc).__name__, exc.errno, str(exc)]
        aligned = torch.full((8192,), 7, dtype=torch.uint8)
        handle.sync_pwrite(aligned, fd, 16384)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        content = f.read()
    out[f"bytes{int(direct)}"] = [content[100:10100] == bytes(data.tolist()),
                                  content[16384:24576] == bytes([7]) * 8192]
print(json.dumps(out))
"""


def test_unaligned_write_through_a_callers_descriptor_the_mode_no_longer_allows(
        aio_module: ModuleType) -> None:
    directory = tempfile.mkdtemp(prefix="deepnvme-fd-edges-")
    try:
        os.chmod(directory, 0o777)  # the child may drop to nobody
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, "-c", CHILD, directory], capture_output=True, text=True,
                             env=env, timeout=240)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout.strip().splitlines()[-1])
        if out["unaligned1"] == "ok":
            pytest.skip("this file system lets the O_DIRECT descriptor be reopened (or O_DIRECT is not in "
                        "effect)")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    # Without O_DIRECT: the caller's own descriptor carries the whole request, whatever the mode.
    assert out["unaligned0"] == "ok" and out["bytes0"] == [True, True]
    # With O_DIRECT: the exact condition, in the error; aligned ranges need no reopen.
    name, code, text = out["unaligned1"]
    assert name == "PermissionError" and code == 13
    assert "opened with O_DIRECT" in text and "without O_DIRECT" in text and "align" in text
    assert out["bytes1"][1]
