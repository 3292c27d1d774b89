"""A pending request's loan of its tensor's memory (csrc/aio/storage_loan.h): share_memory_() of memory
mapped from a file or already shared, under either sharing strategy, never frees memory a worker still
fills; and every op that carries the loan code uses one table of loans per process, so that a storage with
requests in two ops keeps its freeze until the last one ends and is left with its own DataPtr. Whatever can
crash runs in a child process; the fault engine holds a request's first block while the test acts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from builder_helpers import REPO_ROOT
from child import run_in_child

PRELUDE = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.multiprocessing as mp
    from op_builder import AsyncIOBuilder
    m = AsyncIOBuilder().load()
    d = sys.argv[1]
    N = 4 << 20
    data = os.urandom(N)
    path = f"{d}/data"
    with open(path, "wb") as f:
        f.write(data)
    ref = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gates = iter(range(1000))

    def held():
        # A handle whose first block waits for go.1 in a gate folder of its own (the fault engine).
        gate = f"{d}/gate-{next(gates)}"
        os.mkdir(gate)
        os.environ.update(DEEPNVME_FAULT="hold@1", DEEPNVME_FAULT_GATE=gate)
        h = m.aio_handle(1 << 20, 4, False, False, 1, engine="fault")
        return h, gate

    def wait_for(p):
        give_up = time.monotonic() + 60
        while not os.path.exists(p):
            assert time.monotonic() < give_up, p
            time.sleep(0.001)
""")


def test_share_memory_during_a_request_keeps_its_memory_alive(tmp_path: Path) -> None:
    """tensor.share_memory_() while a request is pending copies the tensor into shared memory and destroys
    the DataPtr it replaces. The loan keeps the old memory alive until the request is handed over: a read
    then raises naming share_memory_(), a write writes the bytes it was given; neither touches freed memory
    (plain, page-aligned and fresh memory). Memory already shared stays put; reads into it work."""
    out = run_in_child(tmp_path, PRELUDE + textwrap.dedent("""
        makers = {"plain": lambda: torch.empty(N + 1, dtype=torch.uint8)[1:],
                  "aligned": lambda: m.empty_at_residue(N, 0),
                  "fresh": lambda: m.empty_fresh(N, 0)}
        for kind, make in makers.items():
            h, gate = held()
            t = make()
            assert h.async_pread(t, path) == 0
            wait_for(f"{gate}/held.1")
            t.share_memory_()
            assert t.is_shared()
            junk = [torch.full((1 << 20,), 7, dtype=torch.uint8) for _ in range(16)]  # reuses freed memory
            open(f"{gate}/go.1", "w").close()
            try:
                h.wait()
            except RuntimeError as e:
                assert "share_memory_" in str(e) and path in str(e), e
            else:
                raise AssertionError(f"{kind}: a read into memory replaced by share_memory_() succeeded")
            del junk
            assert h.sync_pread(t, path) == 1 and torch.equal(t, ref), kind  # the shared memory works

            h, gate = held()
            src = make()
            src.copy_(ref)
            m.settle_fresh(src)
            assert h.async_pwrite(src, f"{d}/w-{kind}") == 0
            wait_for(f"{gate}/held.1")
            src.share_memory_()
            junk = [torch.full((1 << 20,), 7, dtype=torch.uint8) for _ in range(16)]
            open(f"{gate}/go.1", "w").close()
            assert h.wait() == 1
            del junk
            with open(f"{d}/w-{kind}", "rb") as f:
                assert f.read() == data, kind

        h, gate = held()
        t = torch.empty(N, dtype=torch.uint8).share_memory_()
        assert h.async_pread(t, path) == 0
        wait_for(f"{gate}/held.1")
        t.share_memory_()  # already shared: the memory stays the same
        open(f"{gate}/go.1", "w").close()
        assert h.wait() == 1 and t.is_shared() and torch.equal(t, ref)
        print("ok")
    """), timeout=120)
    assert out.strip() == "ok"


def test_share_memory_of_mapped_memory_never_frees_it_under_a_request(tmp_path: Path) -> None:
    """Memory mapped from a file (torch.from_file) and memory already shared by file descriptor or by file
    name: under either strategy share_memory_() keeps some of these in place and copies the others into new
    shared memory, unmapping the old. A read pending into any of them (an unaligned view, so that the worker
    itself copies into it) either fills the memory kept, or raises at wait() naming share_memory_(), its
    bytes gone to the old mapping, which the loan kept."""
    out = run_in_child(tmp_path, PRELUDE + textwrap.dedent("""
        def mapped(kind):
            if kind == "from_file":
                backing = f"{d}/backing-{next(gates)}"
                with open(backing, "wb") as f:
                    f.write(bytes(N + 1))
                return torch.from_file(backing, shared=False, size=N + 1, dtype=torch.uint8)
            mp.set_sharing_strategy(kind)
            return torch.empty(N + 1, dtype=torch.uint8).share_memory_()

        outcomes = set()
        for strategy in ("file_descriptor", "file_system"):
            for kind in ("from_file", "file_descriptor", "file_system"):
                base = mapped(kind)
                mp.set_sharing_strategy(strategy)
                t = base[1:]
                del base
                h, gate = held()
                assert h.async_pread(t, path) == 0
                wait_for(f"{gate}/held.1")
                before = t.data_ptr()
                t.share_memory_()
                moved = t.data_ptr() != before
                junk = [torch.full((1 << 20,), 7, dtype=torch.uint8).share_memory_() for _ in range(8)]
                open(f"{gate}/go.1", "w").close()
                try:
                    h.wait()
                except RuntimeError as e:
                    assert moved and "share_memory_" in str(e), (strategy, kind, moved, e)
                else:
                    assert not moved and torch.equal(t, ref), (strategy, kind, moved)
                assert all(int(j.min()) == 7 for j in junk), (strategy, kind)
                outcomes.add(moved)
        assert outcomes == {True, False}, outcomes  # both ways were taken
        print("ok")
    """), timeout=240)
    assert out.strip() == "ok"


def test_every_op_takes_loans_from_one_table(tmp_path: Path) -> None:
    """A second extension with its own copy of storage_loan.cpp (as the gds op has beside the aio op) and the
    aio op lend the same storage: when the aio request ends first the storage stays frozen for the other
    loan, and once both ended it is resizable again and holds its own DataPtr (torch's copy-on-write clone,
    which refuses a foreign one, works)."""
    pytest.importorskip("ninja")
    out = run_in_child(tmp_path, PRELUDE + textwrap.dedent(f"""
        from torch.utils.cpp_extension import load
        twin = load("deepnvme_loan_twin", [{str(REPO_ROOT / "tests/aio/loan_twin.cpp")!r},
                                           {str(REPO_ROOT / "csrc/aio/storage_loan.cpp")!r}],
                    extra_include_paths=[{str(REPO_ROOT / "csrc/aio")!r}], extra_cflags=["-O0"],
                    build_directory=d)
        t = torch.empty(N, dtype=torch.uint8)
        h, gate = held()
        assert h.async_pread(t, path) == 0
        wait_for(f"{{gate}}/held.1")
        loan = twin.lend(t.untyped_storage()._cdata)
        open(f"{{gate}}/go.1", "w").close()
        assert h.wait() == 1 and torch.equal(t, ref)
        assert not t.untyped_storage().resizable(), "the twin's loan lost its freeze"
        twin.end(loan)
        assert t.untyped_storage().resizable()
        t._lazy_clone()
        loan = twin.lend(t.untyped_storage()._cdata)  # the other order: the twin's loan ends first
        assert h.async_pread(t, path) == 0
        twin.end(loan)
        assert not t.untyped_storage().resizable(), "the twin ended the aio request's freeze"
        assert h.wait() == 1 and torch.equal(t, ref)
        assert t.untyped_storage().resizable()
        t._lazy_clone()
        print("ok")
    """), timeout=300)
    assert out.strip() == "ok"


def test_a_forked_child_gets_its_tensors_storages_back(tmp_path: Path) -> None:
    """fork() while a read is pending: the child's copy of the handle refuses work and, once dropped, lets
    go of its copies of the requests' loans (no thread of the child uses them), so the child's tensor is
    resizable again and holds its own DataPtr; the parent's read ends as usual."""
    out = run_in_child(tmp_path, PRELUDE + textwrap.dedent("""
        t = torch.empty(N, dtype=torch.uint8)
        h, gate = held()
        assert h.async_pread(t, path) == 0
        wait_for(f"{gate}/held.1")
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                del h
                if t.untyped_storage().resizable():
                    t._lazy_clone()
                else:
                    code = 3
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        open(f"{gate}/go.1", "w").close()
        assert h.wait() == 1 and torch.equal(t, ref)
        assert t.untyped_storage().resizable()
        print("ok")
    """), timeout=120)
    assert out.strip() == "ok"
