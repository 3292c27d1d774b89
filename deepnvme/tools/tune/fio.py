"""fio once with the winning settings on the same directory: the drive's limit, for comparison."""

from __future__ import annotations

import json
import os
import subprocess

from deepnvme.tools.cli import GB
from op_builder.engines import by_name

__all__ = ["run_fio"]


def run_fio(directory: str, config: dict, io_size: int, do_write: bool, do_read: bool) -> dict[str, float]:
    """fio once with the winning settings on the same directory; GB/s per operation (GB = 1024^3)."""
    engine = by_name(config["engine"]).fio  # the engine catalogue's fio twin of each engine
    jobs = config["intra_op_parallelism"]
    share = max(io_size // jobs // config["block_size"], 1) * config["block_size"]
    path = os.path.join(directory, "_deepnvme_tune_fio.bin")
    out: dict[str, float] = {}
    try:
        for op in [o for o, on in (("write", do_write), ("read", do_read)) if on]:
            args = ["fio", "--output-format=json", "--group_reporting", f"--name=tune_{op}",
                    f"--filename={path}", f"--rw={op}", f"--bs={config['block_size']}", "--direct=1",
                    f"--ioengine={engine}",
                    f"--iodepth={config['queue_depth']}", f"--numjobs={jobs}", f"--size={share}",
                    f"--offset_increment={share}"]
            proc = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr.strip() or proc.stdout.strip())
            text = proc.stdout
            job = json.loads(text[text.index("{"):])["jobs"][0]
            out[op] = job[op]["bw_bytes"] / GB
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out
