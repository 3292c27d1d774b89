"""One configuration measured on every directory at once (one thread and buffer per directory)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from deepnvme._core.aio_types import AioModule
from deepnvme.tools.cli import GB, writer
from deepnvme.tools.pagecache import O_DIRECT, drop_file_cache, read_mode
from deepnvme.tools.resident import touch_pages

__all__ = ["Bench"]


class Bench:
    """Measures one configuration on every directory at once (one thread and buffer per directory)."""

    def __init__(self, aio: AioModule, dirs: list[str], io_size: int, loops: int, do_read: bool,
                 do_write: bool, device: Callable[[int], Any] | None = None) -> None:
        import torch

        self.aio, self.dirs, self.io_size, self.loops = aio, dirs, io_size, loops
        self.do_read, self.do_write = do_read, do_write
        self.paths = [os.path.join(d, f"_deepnvme_tune.{i}.bin") for i, d in enumerate(dirs)]
        self.modes = [read_mode(d) for d in dirs]
        self.owner = aio.aio_handle()
        example = torch.empty(0, dtype=torch.uint8)
        if device is not None:
            self.buffers = [torch.empty(io_size, dtype=torch.uint8, device=device(i))
                            for i in range(len(dirs))]
            self.locked = False
        else:
            self.buffers = [self.owner.new_cpu_locked_tensor(io_size, example) for _ in dirs]
            self.locked = True
        for b in self.buffers:
            b.fill_(0xA5)
        maker = writer(aio)
        for b, p in zip(self.buffers, self.paths):
            maker.sync_pwrite(b, p)  # reads need a full file even when writes are not measured

    def _all(self, handles: list, op: str) -> float:
        """Seconds for every directory to finish one write or read of io_size, side by side."""
        if op == "read":
            for p, m in zip(self.paths, self.modes):
                if m != O_DIRECT:
                    drop_file_cache(p)
        errors: list[BaseException] = []

        def one(h: Any, b: Any, p: str) -> None:
            try:
                (h.sync_pread if op == "read" else h.sync_pwrite)(b, p)
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=a) for a in zip(handles, self.buffers, self.paths)]
        touch_pages(*self.buffers)  # resident before the clock, as fio's are (see deepnvme.tools.resident)
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if errors:
            raise errors[0]
        return elapsed

    def measure(self, config: dict, floor: float = 0.0) -> dict:
        """GB/s for write and read (summed over directories); stops after one loop when below `floor`."""
        handles = [self.aio.aio_handle(**config) for _ in self.dirs]
        total = self.io_size * len(self.dirs)
        speeds: dict[str, list[float]] = {"write": [], "read": []}
        ops = [op for op, on in (("write", self.do_write), ("read", self.do_read)) if on]
        for loop in range(self.loops):
            for op in ops:
                speeds[op].append(total / self._all(handles, op) / GB)
            score = sum(max(v) for v in speeds.values() if v)
            if loop == 0 and floor and score < floor:
                break  # early stopping: far behind the leader, more loops will not change the choice
        result = {op: max(v) for op, v in speeds.items() if v}
        result["score"] = sum(result.get(op, 0.0) for op in ("write", "read"))
        result["engine"] = handles[0].get_engine()
        return result

    def close(self) -> None:
        """Free the buffers and remove the files."""
        if self.locked:
            for b in self.buffers:
                self.owner.free_cpu_locked_tensor(b)
        self.buffers = []
        for p in self.paths:
            if os.path.exists(p):
                os.unlink(p)
