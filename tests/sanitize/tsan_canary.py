"""A deliberate data race through deepnvme, for checking that a ThreadSanitizer setup can see races in the
op's own threads: an async read into a buffer and an async write from it, in flight together on two
workers. Run it under ``tests/sanitize/run.sh thread``; it must end with TSan's exit status (66)."""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from op_builder import AsyncIOBuilder


def main() -> int:
    aio = AsyncIOBuilder().load()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f")
        buf = torch.frombuffer(bytearray(os.urandom(10000)), dtype=torch.uint8)
        h = aio.aio_handle(4096, 4, False, True, 2, engine="posix")
        h.sync_pwrite(buf, path)
        for _ in range(5):
            h.async_pwrite(buf, path, 5)  # worker 1 reads buf ...
            h.async_pread(buf, path)  # ... while worker 2 writes into it
            h.wait()
    print("no race reported", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
