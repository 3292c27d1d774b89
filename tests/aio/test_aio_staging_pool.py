"""Staging-pool bookkeeping: every buffer a staged transfer takes is given back, whether the transfer ran
inline or on a worker, succeeded, failed (fault engine: EIO, ENOSPC, short and zero-length transfers) or was
abandoned half-way. Checked within seconds through staging_pool_stats(), instead of waiting for a leak to
starve a later transfer into a hang."""

from __future__ import annotations

from builder_helpers import run_python

BURST = """
import errno, os, threading
import torch
from op_builder import AsyncIOBuilder

m = AsyncIOBuilder().load()
d = os.environ["BURST_DIR"]
assert m.staging_pool_stats()["free"] == m.staging_pool_stats()["buffers"] == 16
problems = []


def plain(n, value):
    t = torch.empty(n + 1, dtype=torch.uint8)[1:]  # misaligned: staged
    t.fill_(value)
    return t


def clean(engine, k):
    # Inline (one block) and worker (many blocks) requests, sync and async, writes and reads.
    h = m.aio_handle(256 << 10, 8, False, True, 2, engine=engine)
    for i in range(12):
        n = (40 << 10) * (1 + i % 3) if i % 2 else (3 << 20) + 4096 * i
        src = plain(n, i)
        path = f"{d}/{engine}-{k}-{i}"
        if i % 4 == 3:
            assert h.async_pwrite(src, path) == 0
            assert h.wait() == 1
        else:
            assert h.sync_pwrite(src, path) == 1
        dst = plain(n, 255)
        assert h.sync_pread(dst, path) == 1
        if not torch.equal(dst, src):
            problems.append(f"{engine} {k} {i}: wrong bytes")


def failing(rules, h, k, check_each=False):
    failures = 0
    for i in range(10):
        n = (1 << 20) + 4096 * i
        path = f"{d}/fault-{k}-{i}"
        try:
            if i % 2:
                h.sync_pwrite(plain(n, i), path)
            else:
                with open(path, "wb") as f:
                    f.truncate(n)
                h.async_pread(plain(n, 0), path)
                h.async_pread(plain(n // 2, 0), path)
                h.wait()
        except OSError as e:
            failures += 1
            if e.errno not in (errno.EIO, errno.ENOSPC):
                problems.append(f"fault {rules}: {e}")
        # Alone, a finished request holds nothing: a leak shows at once, before it can starve the next.
        stats = m.staging_pool_stats()
        assert not check_each or stats["free"] == 16, f"{rules}, request {i}: {stats}"
    if failures == 0:
        problems.append(f"fault {rules}: nothing failed")


RULES = ["eio@3,enospc@40,short@7", "zero@5,eio@60,eio@90", "unaligned_short@2,enospc@30,eio@70",
         "eio@1,eio@20,eio@50,eio@100"]


def fault_handle(rules):
    os.environ["DEEPNVME_FAULT"] = rules  # read when the handle is made
    return m.aio_handle(64 << 10, 8, False, True, 2, engine="fault")


for k, rules in enumerate(RULES):  # one at a time first
    failing(rules, fault_handle(rules), k, check_each=True)
# Then everything at once: runs contend for the pool.
def guarded(fn, *args):
    def run():
        try:
            fn(*args)
        except BaseException as e:  # reported in the result, not lost with the thread
            problems.append(f"{fn.__name__}{args[:1]}: {e!r}")
    return threading.Thread(target=run)


jobs = [guarded(clean, e, k) for e in m.available_engines() for k in range(2)]
jobs += [guarded(failing, r, fault_handle(r), 10 + k) for k, r in enumerate(RULES)]
for j in jobs:
    j.start()
for j in jobs:
    j.join()
stats = m.staging_pool_stats()
result = {"stats": stats, "problems": problems}
"""


def test_every_staging_buffer_comes_back(workdir) -> None:
    """Failing staged transfers one at a time (all 16 buffers free after each), then a burst from several
    threads and handles, clean and failing, through the pool of 16 x 64 KiB buffers (so runs contend for
    it): afterwards all 16 buffers are free."""
    env = {"DEEPNVME_STAGING_BUFFER_BYTES": str(64 << 10), "DEEPNVME_STAGING_BUFFERS": "16",
           "BURST_DIR": str(workdir)}
    out = run_python(BURST, env=env, timeout=240)["result"]
    assert out["problems"] == []
    assert out["stats"]["allocated"] is True
    assert out["stats"]["free"] == out["stats"]["buffers"] == 16, out["stats"]
