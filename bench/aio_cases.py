"""The aio_handle cases that bench/aio_bench.py and DeepSpeed's side of it (bench/deepspeed_side.py) both
time, so that both processes run the very same calls; neither script imports the other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _harness import timed

from deepnvme._core.aio_types import AioHandle
from deepnvme.tools.pagecache import drop_file_cache
from deepnvme.tools.resident import touch_pages
from deepnvme.tools.sizes import format_size

__all__ = ["MIB", "SMALL_COUNT", "SMALL_SIZE", "Setting", "aio_seq", "aio_small", "handle_settings"]

MIB = 1 << 20
SMALL_COUNT = 1000
SMALL_SIZE = 64 << 10


@dataclass(frozen=True)
class Setting:
    """One grid point: block size, queue depth per thread/job, threads/jobs."""

    block: int
    depth: int
    jobs: int

    def label(self) -> str:
        return f"bs {format_size(self.block)} QD{self.depth} x{self.jobs}"


def handle_settings(engine: str, depth: int, threads: int, block: int = MIB) -> dict:
    """aio_handle keywords for one sequential point (overlapped events, batched submission)."""
    return {"block_size": block, "queue_depth": depth, "single_submit": False, "overlap_events": True,
            "intra_op_parallelism": threads, "engine": engine}


def aio_seq(handle: AioHandle, tensor: Any, path: str, op: str) -> Callable[[], tuple[float, float]]:
    """One sync_pwrite or sync_pread of the whole tensor, open included; the cache dropped before reads and
    the tensor's pages made resident (see deepnvme.tools.resident) before the clock starts."""
    def run() -> tuple[float, float]:
        touch_pages(tensor)
        if op == "read":
            drop_file_cache(path)
            return timed(lambda: handle.sync_pread(tensor, path))
        return timed(lambda: handle.sync_pwrite(tensor, path))

    return run


def aio_small(handle: AioHandle, views: list, paths: list[str], offsets: list[int],
              count_check: bool = True) -> Callable[[], tuple[float, float]]:
    """1000 async_pread calls, then one wait(): the many-small-tensors pattern of offloading.
    ``count_check=False`` for DeepSpeed, whose wait() counts its internal sub-requests."""
    def run() -> tuple[float, float]:
        def body() -> None:
            for v, p, o in zip(views, paths, offsets):
                handle.async_pread(v, p, o)
            done = handle.wait()
            if count_check and done != len(views):
                raise RuntimeError(f"wait() completed {done} of {len(views)} requests")

        return timed(body)

    return run
