"""The swap space on the real disk: units in and out, queues, pre-flight checks, directories, bad input."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from thread_helpers import wait_until

from deepnvme.offload import ReadAhead, SwapSpace
from deepnvme.offload._doors import PAGE, SWAP, locked_bytes, new_handle
from deepnvme.offload.swap import DEMAND, MAX_REQUESTS_IN_FLIGHT, Ticket, folders, preflight
from deepnvme.offload.swap.queues import IOQueue
from tests.offload.helpers import in_forked_child, open_fds, tmpfs

SIZES = [1, 511, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, 100_000]


def _fill(space: SwapSpace, sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    data = []
    for i, n in enumerate(sizes):
        u = space.add(f"u{i}", n)
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        lease = space.allocate([u])
        lease.view(u).copy_(x)
        lease.write_back()
        data.append(x)
    space.wait_writes()
    return data


def test_units_round_trip_true_lengths(workdir: Path) -> None:
    with SwapSpace(workdir, 1 << 20) as space:
        data = _fill(space, SIZES)
        reader = ReadAhead(space, [[space.unit(f"u{i}")] for i in range(len(SIZES))])
        for i, x in enumerate(data):
            lease = reader.take(i)
            assert lease.view(f"u{i}").numel() == x.numel()
            assert torch.equal(lease.view(f"u{i}"), x)
            lease.release()
        reader.close()
        # Every unit starts on a page, padded for O_DIRECT; the file holds the padded lengths.
        assert all(space.unit(f"u{i}").offset % PAGE == 0 for i in range(len(SIZES)))
        assert os.path.getsize(space.file) == space.reserved_bytes
        assert space.pool.in_use == 0


def test_group_lease_and_rewrite(workdir: Path) -> None:
    with SwapSpace(workdir, 1 << 20) as space:
        data = _fill(space, [5000, 9000, 123])
        units = [space.unit(f"u{i}") for i in range(3)]
        lease = space.read(units, demand=True)
        assert len(lease.tickets) == 1  # back to back in the file and in the pool: one request
        lease.wait()
        for u, x in zip(units, data):
            assert torch.equal(lease.view(u), x)
            lease.view(u).add_(1)
        assert len(lease.write_back()) == 1
        space.wait_writes()
        again = space.read(units[::-1])  # out of file order: one request per unit
        assert len(again.tickets) == 3
        again.wait()
        for u, x in zip(units, data):
            assert torch.equal(again.view(u), x + 1)
        again.release()


def test_locked_memory_is_the_budget_and_close_leaves_nothing(workdir: Path) -> None:
    before_locked, before_fds = locked_bytes(), open_fds()
    space = SwapSpace(workdir, 64 * PAGE)
    assert locked_bytes() - before_locked == 64 * PAGE
    _fill(space, [PAGE * 10] * 20)  # 200 pages through a pool of 64
    assert space.pool.peak_in_use <= 64 * PAGE
    path = space.path
    space.close()
    assert locked_bytes() == before_locked
    assert not os.path.exists(path) and os.listdir(workdir) == []
    assert open_fds() - before_fds == set()


def test_writes_never_delay_reads_and_completion_is_per_request(workdir: Path) -> None:
    """A write stuck in the write queue does not hold a read back; a demanded read overtakes prefetches."""
    with SwapSpace(workdir, 1 << 20) as space:
        data = _fill(space, [PAGE] * 6)
        units = [space.unit(f"u{i}") for i in range(6)]
        gate = threading.Event()
        # A write whose completion blocks the write thread until the gate opens.
        block = space.pool.acquire(PAGE)
        stuck = space.writes.submit(Ticket(block.tensor, space._fd, units[0].io_start, space.file, True,
                                           lambda _t: gate.wait()))
        block.tensor.copy_(data[0])
        lease = space.read([units[1]], demand=True)
        lease.wait()  # returns although the write has not completed
        assert torch.equal(lease.view(units[1]), data[1]) and not stuck.done()
        lease.release()
        # Now the read thread: hold it on one read, queue prefetches, then demand the last one.
        order: list[int] = []
        read_gate = threading.Event()
        first = space.reads.submit(Ticket(space.pool.acquire(PAGE).tensor, space._fd, 0, space.file, False,
                                          lambda _t: read_gate.wait()))
        leases = [space.read([units[i]]) for i in range(2, 6)]
        for i, le in zip(range(2, 6), leases):
            for t in le.tickets:
                t.on_done = lambda _t, i=i, then=t.on_done: (order.append(i), then(_t))  # then: its check
        leases[-1].demand()
        read_gate.set()
        first.wait()
        for le in leases:
            le.wait()
        assert order[0] == 5, order
        assert leases[-1].tickets[0].priority == DEMAND
        for le, i in zip(leases, range(2, 6)):
            assert torch.equal(le.view(units[i]), data[i])
            le.release()
        gate.set()
        stuck.wait()


def test_two_requests_in_flight_each_way(workdir: Path) -> None:
    """With requests_in_flight=2 a second read is in the drive while the first still holds its slot (its
    callback has not returned); with both slots taken, further reads wait, and when a slot frees a
    demanded read is issued before queued prefetches; a lease written in several requests in flight at
    once gives its memory back exactly once."""
    with SwapSpace(workdir, 1 << 20, requests_in_flight=2) as space:
        data = _fill(space, [PAGE] * 8)
        units = [space.unit(f"u{i}") for i in range(8)]
        gate = threading.Event()
        held = space.reads.submit(Ticket(space.pool.acquire(PAGE).tensor, space._fd, 0, space.file, False,
                                         lambda _t: gate.wait()))
        wait_until(lambda: held.ended != 0.0, "the held read's callback")  # it holds its slot there
        second = space.read([units[0]])
        wait_until(lambda: second.tickets[0].started, "the second read")  # in the other slot
        leases = [space.read([units[i]]) for i in range(2, 6)]
        leases[-1].demand()
        time.sleep(0.05)  # were a slot free, the issuing thread would have taken one by now
        assert not any(t.started for le in leases for t in le.tickets) and not held.done()
        gate.set()
        for le in [second, *leases]:
            le.wait()
        began = [le.tickets[0].began for le in leases]
        assert began[3] < min(began[:3]) and began[:3] == sorted(began[:3]), began
        assert leases[-1].tickets[0].priority == DEMAND
        for le, i in zip([second, *leases], [0, 2, 3, 4, 5]):
            assert torch.equal(le.view(units[i]), data[i])
            le.release()
        held.wait()
        for _ in range(20):  # units out of file order: one write request each, two in flight
            lease = space.read(units[::-1], demand=True)
            lease.wait()
            assert len(lease.write_back()) == 8
            space.wait_writes()
            assert space.pool.in_use == PAGE  # the held ticket's buffer only
        for i, u in enumerate(units):
            lease = space.read([u], demand=True)
            lease.wait()
            assert torch.equal(lease.view(u), data[i])
            lease.release()


def test_many_requests_in_flight_complete_each_on_its_own(workdir: Path) -> None:
    """requests_in_flight=8 on one handle per direction: every ticket completes on its own, with its own
    bytes; an issued request that fails (its file cut short under the space) fails its ticket alone, with
    an OSError naming the file, and the requests around it succeed."""
    path = workdir / "ext.bin"
    gen = torch.Generator().manual_seed(3)
    payload = torch.randint(0, 256, (64 * PAGE,), dtype=torch.uint8, generator=gen)
    path.write_bytes(payload.numpy().tobytes())
    with SwapSpace(None, 1 << 20, requests_in_flight=8) as space:
        units = [space.add_external(f"e{i}", path, i * 8 * PAGE, 8 * PAGE) for i in range(8)]
        leases = [space.read([u]) for u in units]
        for i, (le, u) in enumerate(zip(leases, units)):
            le.wait()
            assert torch.equal(le.view(u), payload[i * 8 * PAGE:(i + 1) * 8 * PAGE])
            le.release()
        os.truncate(path, 4 * 8 * PAGE)  # the last four units are gone
        leases = [space.read([u]) for u in units]
        for i, le in enumerate(leases):
            if i < 4:
                le.wait()
                assert torch.equal(le.view(units[i]), payload[i * 8 * PAGE:(i + 1) * 8 * PAGE])
            else:
                with pytest.raises(OSError, match="ext.bin") as info:
                    le.wait()
                assert info.value.errno == errno.EIO and info.value.filename == str(path)
            le.release()


@pytest.mark.parametrize("parts", [2, 3, 64])
def test_requests_cut_into_parts(workdir: Path, parts: int) -> None:
    """Reads and writes cut into `parts` requests: page-aligned pieces that cover each run exactly once (a
    run shorter than `parts` pages moves in fewer), on two threads each way; the bytes round trip, and a
    lease's memory goes back once, after its last piece is written."""
    sizes = [3 * PAGE + 17, 5, 9 * PAGE, 100_000]
    with SwapSpace(workdir, 1 << 20, requests_in_flight=2,
                   handle_settings={"block_size": 2 * PAGE, "queue_depth": 2}) as space:
        assert space.handle_settings["block_size"] == 2 * PAGE
        data = _fill(space, sizes)
        units = [space.unit(f"u{i}") for i in range(len(sizes))]
        total = sum(u.io_nbytes for u in units)
        for _ in range(5):
            lease = space.read(units, demand=True, parts=parts)
            pieces = sorted((t.offset, t.tensor.numel()) for t in lease.tickets)
            assert len(pieces) == min(parts, total // PAGE)
            assert all(off % PAGE == 0 and n % PAGE == 0 for off, n in pieces)
            assert [off for off, _ in pieces] == [0] + [sum(n for _, n in pieces[:i]) for i in
                                                       range(1, len(pieces))]
            assert sum(n for _, n in pieces) == total
            lease.wait()
            for u, x in zip(units, data):
                assert torch.equal(lease.view(u), x)
                lease.view(u).add_(1)
            data = [x + 1 for x in data]
            assert len(lease.write_back(parts)) == len(pieces)
            space.wait_writes()
            assert space.pool.in_use == 0
        lease = space.read(units, demand=True)
        lease.wait()
        assert all(torch.equal(lease.view(u), x) for u, x in zip(units, data))
        lease.release()


def test_read_ahead_cuts_the_ends_of_a_walk(workdir: Path) -> None:
    """end_parts: the first and the last group's reads in that many requests, the others in one; a cyclic
    walk has no ends."""
    with SwapSpace(workdir, 1 << 20, requests_in_flight=2) as space:
        data = _fill(space, [4 * PAGE] * 5)
        groups = [[space.unit(f"u{i}")] for i in range(5)]
        reader = ReadAhead(space, groups, end_parts=2)
        for i in range(5):
            lease = reader.take(i)
            assert len(lease.tickets) == (2 if i in (0, 4) else 1), i
            assert torch.equal(lease.view(f"u{i}"), data[i])
            lease.release()
        reader.close()
        cyclic = ReadAhead(space, groups, cyclic=True, end_parts=2)
        for i in range(7):
            lease = cyclic.take(i)
            assert len(lease.tickets) == 1
            lease.release()
        cyclic.close()


@pytest.mark.parametrize(("settings", "error"), [({"block_size": 0}, ValueError),
                                                 ({"queue_depth": "8"}, TypeError),
                                                 ({"blocksize": 4096}, ValueError)])
def test_handle_settings_checked(workdir: Path, settings: dict, error: type) -> None:
    with pytest.raises(error, match=next(iter(settings))):
        SwapSpace(workdir, 1 << 20, handle_settings=settings)
    assert os.listdir(workdir) == []


@pytest.mark.parametrize("bad", [0, MAX_REQUESTS_IN_FLIGHT + 1, True, 1.5, "2"])
def test_requests_in_flight_checked(workdir: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="requests_in_flight"):
        SwapSpace(workdir, 1 << 20, requests_in_flight=bad)  # type: ignore[arg-type]
    assert os.listdir(workdir) == []


def test_read_ahead_stops_at_the_budget(workdir: Path) -> None:
    with SwapSpace(workdir, 4 * PAGE) as space:
        data = _fill(space, [PAGE] * 10)
        reader = ReadAhead(space, [[space.unit(f"u{i}")] for i in range(10)])
        for i in range(10):
            lease = reader.take(i)
            assert torch.equal(lease.view(f"u{i}"), data[i])
            assert space.pool.in_use <= 4 * PAGE
            lease.release()
        reader.close()


def test_external_units_at_any_offset(workdir: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    blob = torch.randint(0, 256, (5 * PAGE + 123,), dtype=torch.uint8, generator=gen)
    path = workdir / "shard.bin"
    path.write_bytes(blob.numpy().tobytes())
    ranges = [(0, 10), (7, PAGE), (PAGE, PAGE), (3 * PAGE - 5, 2 * PAGE), (5 * PAGE, 123),
              (100, 5 * PAGE + 23)]
    with SwapSpace(workdir, 1 << 20) as space:
        units = [space.add_external(f"t{i}", path, off, n) for i, (off, n) in enumerate(ranges)]
        lease = space.read(units)
        lease.wait()
        for u, (off, n) in zip(units, ranges):
            assert torch.equal(lease.view(u), blob[off:off + n])
        lease.write_back()  # read-only units are never written
        space.wait_writes()
        with pytest.raises(ValueError, match="past the end"):
            space.add_external("late", path, 5 * PAGE, 124)
    assert path.read_bytes() == blob.numpy().tobytes()


def test_read_only_space_cyclic_read_ahead_and_checks(workdir: Path) -> None:
    """A space without a directory reads external units only; a cyclic ReadAhead wraps around forever and
    restarts where told; a read's check runs once its bytes are in and its error is the lease's."""
    gen = torch.Generator().manual_seed(4)
    blob = torch.randint(0, 256, (6 * PAGE,), dtype=torch.uint8, generator=gen)
    path = workdir / "weights.bin"
    path.write_bytes(blob.numpy().tobytes())
    before = set(os.listdir(workdir))
    checked: list[str] = []

    def check(lease: object) -> None:
        name = lease.units[0].name  # type: ignore[attr-defined]
        checked.append(name)
        if name == "bad":
            raise ValueError("checksum of 'bad' does not match")

    with SwapSpace(None, 3 * PAGE) as space:
        assert space.directory is None and space.file is None
        with pytest.raises(RuntimeError, match="read-only"):
            space.add("owned", PAGE)
        units = [space.add_external(f"u{i}", path, i * PAGE, PAGE) for i in range(4)]
        reader = ReadAhead(space, [[u] for u in units], cyclic=True, check=check)
        for pos in [*range(9), 13, 14]:
            if pos == 13:
                reader.restart(13)
            lease = reader.take(pos)
            assert torch.equal(lease.view(units[pos % 4]), blob[pos % 4 * PAGE:(pos % 4 + 1) * PAGE])
            assert space.pool.in_use <= 3 * PAGE
            lease.release()
        reader.close()
        assert space.pool.in_use == 0 and checked[:4] == ["u0", "u1", "u2", "u3"]
        bad = space.read([space.add_external("bad", path, 5 * PAGE, 100)], check=check)
        with pytest.raises(ValueError, match="checksum of 'bad'"):
            bad.wait()
        bad.release()
        with pytest.raises(ValueError, match="at least one group"):
            ReadAhead(space, [], cyclic=True)
    assert set(os.listdir(workdir)) == before


def test_budget_checks(workdir: Path) -> None:
    with pytest.raises(ValueError, match="budget_bytes=0"):
        SwapSpace(workdir, 0)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        SwapSpace(workdir, 1.5e6)  # type: ignore[arg-type]
    with SwapSpace(workdir, 2 * PAGE) as space, pytest.raises(ValueError, match="raise budget_bytes to"):
        space.add("big", 2 * PAGE + 1)
    assert os.listdir(workdir) == []


def test_memlock_check_names_limit_and_fix() -> None:
    with pytest.raises(ValueError, match=r"RLIMIT_MEMLOCK is 8388608 bytes.*ulimit -l"):
        preflight.check_memlock(16 << 20, 0, limit=8 << 20, privileged=False)
    preflight.check_memlock(16 << 20, 0, limit=8 << 20, privileged=True)
    preflight.check_memlock(4 << 20, 0, limit=8 << 20, privileged=False)


def test_memlock_refused_without_the_capability(workdir: Path) -> None:
    """A process without CAP_IPC_LOCK and an 8 MiB limit gets the error before anything is created."""
    if not preflight.has_cap_ipc_lock():
        pytest.skip("already without CAP_IPC_LOCK; the pure check above covers it")
    code = ("import resource,sys; resource.setrlimit(resource.RLIMIT_MEMLOCK,(8<<20,8<<20));"
            "from deepnvme.offload import SwapSpace\n"
            "try:\n SwapSpace(sys.argv[1], 64<<20)\nexcept ValueError as e:\n print('REFUSED', e)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(["capsh", "--drop=cap_ipc_lock", "--", "-c", f'{sys.executable} -c "$0" "$1"', code,
                           str(workdir)], capture_output=True, text=True, env=env)
    if done.returncode != 0 and "REFUSED" not in done.stdout:
        pytest.skip(f"capsh could not drop the capability: {done.stderr.strip()[-300:]}")
    assert "REFUSED" in done.stdout and "budget_bytes=67108864" in done.stdout, done.stdout + done.stderr
    assert os.listdir(workdir) == []


def test_full_disk_names_directory(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=256k") as mnt:
        with pytest.raises(OSError, match="free space") as err:
            SwapSpace(mnt, 1 << 20, expected_bytes=10 << 20)
        assert err.value.filename == str(mnt)
        with SwapSpace(mnt, 1 << 20) as space:
            with pytest.raises(OSError, match="no space for") as err:
                for i in range(200):
                    space.add(f"u{i}", 8 * PAGE)
            assert err.value.errno == 28 and err.value.filename == str(mnt)
        assert os.listdir(mnt) == []


def test_read_only_directory(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mnt, pytest.raises(OSError, match="not writable") as err:
        SwapSpace(mnt, 1 << 20)
    assert err.value.filename == str(mnt)


def test_missing_directory_is_created_with_its_parents(tmp_path: Path) -> None:
    """As DCP's FileSystemWriter, accelerate's offload_folder and DeepSpeed's swappers do; close() removes
    the space's own folder only, not the directories it made for it."""
    where = tmp_path / "a" / "b" / "swap"
    with SwapSpace(where, 1 << 20) as space:
        space.add("u", 10)
        assert where.is_dir() and Path(space.file).parent.parent.parent == where
    assert where.is_dir() and os.listdir(where) == []


def test_a_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="not a directory") as err:
        SwapSpace(tmp_path / "file", 1 << 20)
    assert err.value.errno == errno.ENOTDIR and err.value.filename == str(tmp_path / "file")
    with pytest.raises(OSError, match="cannot create the swap directory") as err:
        SwapSpace(tmp_path / "file" / "under", 1 << 20)  # a parent is a regular file
    assert err.value.errno == errno.ENOTDIR and err.value.filename == str(tmp_path / "file" / "under")
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mnt, pytest.raises(OSError, match="cannot create") as err:
        SwapSpace(mnt / "new", 1 << 20)  # root too: a read-only file system refuses everyone
    assert err.value.errno == errno.EROFS and err.value.filename == str(mnt / "new")
    assert sorted(os.listdir(tmp_path)) == ["file", "ro"]


def test_stale_directories_of_dead_processes_only(workdir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = workdir / f"{folders.PREFIX}{folders.HOST}-{dead.pid}-12345"
    reused = workdir / f"{folders.PREFIX}{folders.HOST}-{os.getppid()}-1"  # a live pid, another start time
    live = workdir / folders.own_name(os.getppid())
    other_host = workdir / f"{folders.PREFIX}elsewhere-{dead.pid}-12345"
    for d in (stale, reused, live, other_host):
        (d / "space-0").mkdir(parents=True)
        (d / "space-0" / "swap.bin").write_bytes(b"x")
    with SwapSpace(workdir, 1 << 20) as space:
        assert not stale.exists() and not reused.exists()
        assert live.exists() and other_host.exists()
        assert Path(space.path).parent.name == folders.own_name()
        with SwapSpace(workdir, 1 << 20) as second:  # two spaces of one process keep apart
            assert second.path != space.path and Path(second.path).parent == Path(space.path).parent


def test_deleted_or_truncated_swap_file(workdir: Path) -> None:
    with SwapSpace(workdir, 1 << 20) as space:
        _fill(space, [PAGE * 3])
        os.truncate(space.file, PAGE)
        with pytest.raises(OSError, match="truncated") as err:
            space.check_files()
        assert err.value.filename == space.file
        lease = space.read([space.unit("u0")])
        with pytest.raises(OSError) as err:
            lease.wait()
        assert err.value.filename == space.file
        lease.release()
        os.unlink(space.file)
        with pytest.raises(OSError, match="deleted") as err:
            space.check_files()
        assert err.value.filename == space.file


def test_closed_space_refuses(workdir: Path) -> None:
    space = SwapSpace(workdir, 1 << 20)
    u = space.add("a", 10)
    space.close()
    space.close()
    with pytest.raises(RuntimeError, match="closed"):
        space.read([u])


def test_directory_refusing_o_direct_goes_buffered_with_a_warning(tmp_path: Path) -> None:
    from mounts import mounted

    with mounted(tmp_path / "ramfs", "ramfs") as mnt:
        with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported"):
            space = SwapSpace(mnt, 1 << 20)
        with space:
            assert not space.direct
            data = _fill(space, [100, PAGE + 3])
            lease = space.read([space.unit("u0"), space.unit("u1")])
            lease.wait()
            assert torch.equal(lease.view("u0"), data[0]) and torch.equal(lease.view("u1"), data[1])
            lease.release()
        assert os.listdir(mnt) == []


def test_a_check_never_holds_up_the_next_read(workdir: Path) -> None:
    """Checks run on a thread of their own: while the check of one lease is still running, the next lease's
    read completes (the drive never idles for a checksum); each lease's wait() returns only once its own
    check has run, release() waits for a running check (it reads the memory), and a failed read's lease
    raises the read's error without a check."""
    gen = torch.Generator().manual_seed(5)
    blob = torch.randint(0, 256, (4 * PAGE,), dtype=torch.uint8, generator=gen)
    path = workdir / "weights.bin"
    path.write_bytes(blob.numpy().tobytes())
    started, go = threading.Event(), threading.Event()
    checked: list[str] = []

    def check(lease: object) -> None:
        name = lease.units[0].name  # type: ignore[attr-defined]
        if name == "a":
            started.set()
            if not go.wait(60):
                raise RuntimeError("the test never released the check")
        checked.append(name)

    with SwapSpace(None, 4 * PAGE) as space:
        a, b = (space.add_external(n, path, i * PAGE, PAGE) for i, n in enumerate("ab"))
        first = space.read([a], check=check)
        assert started.wait(60), "the first lease's check never started"
        second = space.read([b], check=check)
        for t in second.tickets:
            assert t._done.wait(60), "the second read waited for the first lease's check"
        assert not first.done() and checked == []
        go.set()
        first.wait()
        second.wait()
        assert checked == ["a", "b"] and first.done() and second.done()
        assert torch.equal(second.view(b), blob[PAGE:2 * PAGE])
        first.release()
        second.release()
        late = space.add_external("late", path, 3 * PAGE, PAGE)
        os.truncate(path, PAGE)  # cut short after the unit was added: its read fails
        failed = space.read([late], check=check)
        with pytest.raises(OSError) as err:
            failed.wait()
        assert err.value.filename == str(path) and failed.done()
        failed.release()
        assert checked == ["a", "b"] and space.pool.in_use == 0


def test_a_forked_child_leaves_the_parents_space_alone(workdir: Path) -> None:
    """In a forked child the inherited space refuses work (its I/O threads stayed in the parent: a read
    would never complete) with an error saying so, and closing it there removes nothing of the parent's;
    the parent's space goes on working."""
    with SwapSpace(workdir, 4 * PAGE) as space:
        data = _fill(space, [PAGE, 100])
        units = [space.unit("u0"), space.unit("u1")]

        def child() -> None:
            try:
                space.read(units)
            except RuntimeError as exc:
                if "before fork()" not in str(exc):
                    raise
            else:
                raise AssertionError("the inherited space read in the child")
            space.close()

        assert in_forked_child(child) == "ok"
        assert space.path is not None and os.path.isdir(space.path) and os.path.exists(space.file)
        lease = space.read(units)
        lease.wait()
        assert torch.equal(lease.view(units[0]), data[0]) and torch.equal(lease.view(units[1]), data[1])
        lease.release()


def test_pool_places_a_buffer_within_a_range_when_it_can(workdir: Path) -> None:
    """`within`: the buffer goes into the free part of that range of the pool (splitting a free range on
    both sides), else first fit anywhere; ranges given back merge again."""
    with SwapSpace(workdir, 8 * PAGE) as space:
        pool = space.pool
        a = pool.acquire(PAGE, within=(3 * PAGE, 5 * PAGE))
        assert a is not None and a.start == 3 * PAGE
        b = pool.acquire(2 * PAGE, within=(3 * PAGE, 5 * PAGE))  # no room there: first fit
        assert b is not None and b.start == 0
        c = pool.acquire(PAGE, within=(0, 4 * PAGE))
        assert c is not None and c.start == 2 * PAGE
        d = pool.acquire(4 * PAGE, block=False)
        assert d is not None and d.start == 4 * PAGE and pool.acquire(PAGE, block=False) is None
        for buf in (a, b, c, d):
            buf.release()
        assert pool.in_use == 0 and pool._free == [(0, 8 * PAGE)]


def test_signals_while_submitting_strand_nothing(workdir: Path) -> None:
    """A signal handler raising in the submitting thread every 0.2 ms (as Ctrl-C does) never strands a
    request: every ticket submit() returned completes with its bytes, the queue's threads live on, and
    close() drains and returns. (Requests are issued by the queue's own threads, which Python never
    interrupts; a signal can only land before or after a ticket is queued.)"""
    path = workdir / "ext.bin"
    path.write_bytes(bytes(range(256)) * (PAGE // 256))

    class Interrupted(Exception):
        pass

    def child() -> None:
        import signal

        def handler(_signum: int, frame: object) -> None:
            while frame is not None:  # only inside submit() (or what it calls), where the test catches it
                if frame.f_code is IOQueue.submit.__code__:  # type: ignore[attr-defined]
                    raise Interrupted
                frame = frame.f_back  # type: ignore[attr-defined]

        space = SwapSpace(None, 64 * PAGE, requests_in_flight=4)
        space.add_external("e", path, 0, PAGE)
        fd = space._ext[str(path)]
        returned, interrupted = [], 0
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
        try:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                try:  # memory of its own (not the pool's): a ticket cut off before it was queued keeps it
                    returned.append(space.reads.submit(Ticket(torch.empty(PAGE, dtype=torch.uint8), fd, 0,
                                                              str(path), False)))
                except Interrupted:
                    interrupted += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
        assert interrupted > 0 and len(returned) > 100, (interrupted, len(returned))
        for t in returned:
            t.wait()
            assert bytes(t.tensor[:256].tolist()) == bytes(range(256))
        assert all(th.is_alive() for th in space.reads._threads)
        space.close()
        assert not any(th.is_alive() for th in space.reads._threads)

    assert in_forked_child(child) == "ok"


def test_a_shared_handle_whose_completions_are_taken_elsewhere(workdir: Path) -> None:
    """A handle given to the space is the read queue's: a caller calling its wait_completed may take the
    queue's report of a request; the queue still finishes that ticket (request_done tells it), and close()
    returns."""
    path = workdir / "f.bin"
    path.write_bytes(b"x" * (2 * PAGE))
    h = new_handle(**SWAP)
    queue = IOQueue(h, "read", 2)
    fd = os.open(path, os.O_RDONLY)
    try:
        bufs = [torch.empty(PAGE, dtype=torch.uint8) for _ in range(2)]
        gate = threading.Event()  # held shut until the caller has taken the report: no race with a timer
        slow = queue.submit(Ticket(bufs[0], fd, 0, str(path), False, lambda _t: gate.wait()))
        wait_until(lambda: slow.ended != 0.0, "the first read's callback")  # the completing thread is busy
        other = queue.submit(Ticket(bufs[1], fd, PAGE, str(path), False))
        wait_until(lambda: other.started, "the second read")
        taken = h.wait_completed(60.0)  # the queue's report, taken by someone else
        gate.set()
        assert taken, "the second read was reported to the caller"
        other.wait()  # finished all the same
        assert bytes(bufs[1][:4].tolist()) == b"xxxx"
        slow.wait()
        closer = threading.Thread(target=queue.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive()
    finally:
        os.close(fd)


def test_submits_racing_close_never_hang(workdir: Path) -> None:
    """A submit() racing close() either raises RuntimeError or returns a ticket that finishes (read, or
    refused with RuntimeError), never one that waits forever."""
    path = workdir / "f.bin"
    path.write_bytes(b"y" * PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(30):
            queue = IOQueue(new_handle(**SWAP), "read", 2)
            returned: list[Ticket] = []

            def submitter(q: IOQueue = queue, out: list[Ticket] = returned) -> None:
                for _ in range(200):
                    try:
                        out.append(q.submit(Ticket(torch.empty(PAGE, dtype=torch.uint8), fd, 0, str(path),
                                                   False)))
                    except RuntimeError:
                        return

            t = threading.Thread(target=submitter)
            t.start()
            queue.close()
            t.join(10)
            assert not t.is_alive()
            for ticket in returned:
                ticket._done.wait(10)
                assert ticket.done()
                assert ticket.error is None or isinstance(ticket.error, RuntimeError), ticket.error
    finally:
        os.close(fd)


def test_a_byte_changed_on_the_drive_is_caught_when_read_back(workdir: Path) -> None:
    """Every owned unit is read back against the CRC-32 it was written with: one byte flipped in the swap
    file is an OSError EIO naming the file and the unit, not data; the units around it read fine."""
    with SwapSpace(workdir, 1 << 20) as space:
        data = _fill(space, [3 * PAGE, 5000, PAGE])
        units = [space.unit(f"u{i}") for i in range(3)]
        fd = os.open(space.file, os.O_RDWR)
        try:
            at = units[1].offset + 1234
            old = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([old[0] ^ 0x10]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
        lease = space.read(units, demand=True)
        with pytest.raises(OSError, match=r"swapped unit 'u1'.*CRC-32") as err:
            lease.wait()
        assert err.value.errno == errno.EIO and err.value.filename == space.file
        lease.release()
        for i in (0, 2):
            lease = space.read([units[i]], demand=True)
            lease.wait()
            assert torch.equal(lease.view(units[i]), data[i])
            lease.release()
