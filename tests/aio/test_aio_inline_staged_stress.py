"""The inline staged path under threads: sync requests of plain, misaligned tensors longer than one staging
buffer run on their callers' threads, each through a run of several pool buffers, from several threads at
once. Every byte of every file and every read, and guard bytes around each tensor, are checked: a run one
buffer short, or one that overlaps another thread's, corrupts a neighbour's transfer without an error."""

from __future__ import annotations

from builder_helpers import run_python

# A small pool granule: tensors of 20-64 KiB take runs of 2-4 of its 8 buffers (a run is at most half).
BUFFER = 16 << 10

STRESS = """
import os, random, threading
import torch
from op_builder import AsyncIOBuilder

m = AsyncIOBuilder().load()
d = os.environ["STRESS_DIR"]
GUARD, POISON = 4096, 0xA5
threads, rounds = 4, 60
errors = []


def one_thread(h, engine, k):
    rnd = random.Random(k)
    for i in range(rounds):
        if errors:
            return  # one wrong byte fails the test: stop early, so that it fails in seconds
        size = rnd.randrange(20 << 10, 64 << 10)
        misalign = rnd.randrange(1, 64, 2)  # odd: never aligned for O_DIRECT, so staged
        seeded = torch.Generator().manual_seed(k * 1000 + i)
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=seeded)
        src_all = torch.full((size + 2 * GUARD,), POISON, dtype=torch.uint8)
        src = src_all[GUARD + misalign:GUARD + misalign + size]
        src.copy_(data)
        path = f"{d}/{engine}-{k}-{i}"
        assert h.sync_pwrite(src, path) == 1
        with open(path, "rb") as f:
            on_disk = f.read()
        if on_disk != data.numpy().tobytes():
            errors.append(f"{engine} thread {k} write {i}: the file differs from the tensor ({size} bytes)")
        dst_all = torch.full((size + 2 * GUARD,), POISON, dtype=torch.uint8)
        dst = dst_all[GUARD + misalign:GUARD + misalign + size]
        dst.zero_()
        assert h.sync_pread(dst, path) == 1
        if not torch.equal(dst, data):
            errors.append(f"{engine} thread {k} read {i}: the tensor differs from the file ({size} bytes)")
        for name, whole, t in (("source", src_all, src), ("destination", dst_all, dst)):
            start = GUARD + misalign
            if not (bool((whole[:start] == POISON).all()) and bool((whole[start + size:] == POISON).all())):
                errors.append(f"{engine} thread {k} round {i}: bytes around the {name} tensor changed")
        os.unlink(path)


def guarded(h, engine, k):
    try:
        one_thread(h, engine, k)
    except BaseException as e:  # reported in the result, not lost with the thread
        errors.append(f"{engine} thread {k}: {e!r}")


checked = 0
for engine in m.available_engines():
    # A block larger than every tensor: each sync request is one operation, which runs inline.
    h = m.aio_handle(1 << 20, 8, False, False, 1, engine=engine)
    ts = [threading.Thread(target=guarded, args=(h, engine, k)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    checked += threads * rounds
assert m.staging_pool_stats()["buffers"] == 8
result = {"errors": errors[:10], "count": len(errors), "checked": checked}
"""


def test_inline_staged_runs_from_several_threads(workdir) -> None:
    """4 threads x 60 write+read rounds per engine, through a pool of 8 x 16 KiB buffers."""
    env = {"DEEPNVME_STAGING_BUFFER_BYTES": str(BUFFER), "DEEPNVME_STAGING_BUFFERS": "8",
           "STRESS_DIR": str(workdir)}
    out = run_python(STRESS, env=env, timeout=240)["result"]
    assert out["checked"] > 0
    assert out["count"] == 0, out["errors"]
