"""The swap space: named units of bytes in files on a drive, moved through one budgeted pool of locked memory.

A unit is a byte range of a file: (file, offset, nbytes). Units the space owns live in one swap file of its
own subdirectory (see folders.py), each at a page-aligned offset and padded to whole pages for O_DIRECT, the
true length kept; units of existing files (read-only, e.g. tensors in a safetensors shard) are read from
where they are, the pages around them read too so that the read stays O_DIRECT, and the view given back is
the true range. Space for owned units is reserved with fallocate when they are added, so a full disk shows
up then, naming the directory, and never as a short write later; a unit removed gives its range back
(extents.py).

Reads and writes go through two queues (queues.IOQueue), each keeping `requests_in_flight` requests in
flight on one aio handle (one by default) and completing each on its own ticket. Units that lie back to
back in a file and in a lease move in one request. A `Lease` is the memory of a group of units (one pool
buffer, the units laid out in it at page boundaries) and the tickets of their reads; `ReadAhead` issues the
leases of a sequence of groups in order, as far ahead as the pool has room, and demands the one the caller
needs next.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import errno
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepnvme.offload._doors import PAGE, check_settings, crc32, locked_bytes, new_handle
from deepnvme.offload.swap import folders, preflight
from deepnvme.offload.swap.closing import Closing
from deepnvme.offload.swap.extents import Extents
from deepnvme.offload.swap.pool import Buffer, BufferPool, round_up
from deepnvme.offload.swap.queues import DEMAND, PREFETCH, IOQueue, Ticket, check_runner, run_check

SWAP_FILE = "swap.bin"
#: The most requests a queue keeps in flight: each holds a pool buffer's worth of the budget in the drive,
#: and past a few the drive is saturated (the handle splits each request over its own queue depth).
MAX_REQUESTS_IN_FLIGHT = 64
# Spaces still open when the interpreter exits are closed first: a read still in flight on a handle's
# threads at exit would otherwise end the process with std::terminate.
_OPEN: weakref.WeakSet[SwapSpace] = weakref.WeakSet()


@atexit.register
def _close_open_spaces() -> None:
    for space in list(_OPEN):
        try:
            space.close()
        except Exception:  # noqa: BLE001 - exiting: nothing can be done with the error
            pass


@dataclass(frozen=True)
class Unit:
    """`nbytes` at `offset` of `path`; `owned` units are the swap space's (writable), others read-only."""

    name: str
    path: str
    offset: int
    nbytes: int
    owned: bool
    io_start: int  # the page-aligned range read or written for it
    io_end: int

    @property
    def io_nbytes(self) -> int:
        return self.io_end - self.io_start

    @property
    def head(self) -> int:
        """Where the unit's bytes start in its I/O range."""
        return self.offset - self.io_start


class Lease:
    """Pool memory holding a group of units, and the tickets of the requests on it."""

    def __init__(self, space: SwapSpace, units: Sequence[Unit], buffer: Buffer) -> None:
        self.space, self.units, self.buffer = space, list(units), buffer
        self.tickets: list[Ticket] = []
        # The check of the read bytes (SwapSpace.read), when one is made.
        self.checked: concurrent.futures.Future[None] | None = None
        self._slot: dict[str, int] = {}
        at = 0
        for u in self.units:
            self._slot[u.name] = at
            at += round_up(u.io_nbytes)
        self._writes_left = 0
        self._writes_lock = threading.Lock()  # a queue completes a lease's writes on either of its threads

    @staticmethod
    def size_of(units: Sequence[Unit]) -> int:
        """Pool bytes a lease of `units` takes."""
        return sum(round_up(u.io_nbytes) for u in units)

    def io_view(self, unit: Unit) -> Any:
        at = self._slot[unit.name]
        return self.buffer.tensor[at:at + unit.io_nbytes]

    def runs(self, units: Sequence[Unit], parts: int = 1) -> list[tuple[Any, int, str]]:
        """(pool view, file offset, path) of one request per run of units that lie back to back both in the
        pool and in one file (the parameters of a tile, written in order, do): one request per tile
        rather than one per tensor. With `parts` > 1 each run is cut into that many requests (whole pages
        each), so that several requests of one lease are in flight at once."""
        out: list[list[Any]] = []  # [slot, io_start, io_end, path]
        for u in units:
            slot = self._slot[u.name]
            last = out[-1] if out else None
            if (last is not None and last[3] == u.path and last[2] == u.io_start
                    and last[0] + (last[2] - last[1]) == slot):
                last[2] = u.io_end
            else:
                out.append([slot, u.io_start, u.io_end, u.path])
        requests = []
        for slot, start, end, path in out:
            piece = round_up(-(-(end - start) // max(1, parts)))
            requests += [(self.buffer.tensor[slot + at:slot + min(at + piece, end - start)], start + at, path)
                         for at in range(0, end - start, piece)]
        return requests

    def view(self, unit: Unit | str) -> Any:
        """A uint8 tensor over the unit's true bytes in the pool (valid until the lease is released)."""
        u = unit if isinstance(unit, Unit) else self.space.unit(unit)
        at = self._slot[u.name] + u.head
        return self.buffer.tensor[at:at + u.nbytes]

    def demand(self) -> None:
        """Serve this lease's reads before queued prefetches (its write-back, once made, is not a read)."""
        for t in self.tickets:
            if not t.write:
                self.space.reads.demand(t)

    def done(self) -> bool:
        """Whether every request of this lease, and the check of its bytes, has finished (wait() would not
        block)."""
        return all(t.done() for t in self.tickets) and (self.checked is None or self.checked.done())

    def failed(self) -> bool:
        """Whether a request of this lease, or the check of its bytes, has ended in an error (False while
        they run)."""
        c = self.checked
        return (any(t.done() and t.error is not None for t in self.tickets)
                or (c is not None and c.done() and (c.cancelled() or c.exception() is not None)))

    def wait(self) -> None:
        """Wait for this lease's requests only, then for the check of their bytes; raise the first error
        once all of them have finished."""
        self.wait_reads()
        if self.checked is not None:
            self.checked.result()

    def wait_reads(self) -> None:
        """Wait for this lease's requests only, not for the check of their bytes; raise the first error.
        The bytes are then in memory but not yet known to be right: nothing computed from them may be
        used before wait() has returned."""
        for t in self.tickets:
            t.settle()
        for t in self.tickets:
            t.raise_error()

    def write_back(self, parts: int = 1) -> list[Ticket]:
        """Queue writes of every owned unit from the pool; memory goes back to the pool once written.
        `parts` cuts each run into that many requests (see runs())."""
        self.wait()
        owned = [u for u in self.units if u.owned]
        if not owned:
            self.buffer.release()
            return []
        runs = self.runs(owned, parts)
        self._writes_left = len(runs)
        self.tickets = [Ticket(view, self.space._fd, start, path, True, self._written)
                        for view, start, path in runs]
        for t in self.tickets:
            self.space._track_write(self.space.writes.submit(t))
        return self.tickets

    def _written(self, _ticket: Ticket) -> None:
        with self._writes_lock:
            self._writes_left -= 1
            last = self._writes_left == 0
        if last:  # the CRC-32s are taken here, off the caller's thread, before any waiter is released
            try:
                self.space.record_sums(self, [u for u in self.units if u.owned])
            finally:
                self.buffer.release()

    def release(self) -> None:
        """Give the memory back without writing (requests in flight, and a check reading the bytes, finish
        first)."""
        for t in self.tickets:
            t.settle()
        if self.checked is not None:
            concurrent.futures.wait([self.checked])
        self.buffer.release()


class SwapSpace(Closing):
    """Units of bytes in files, moved through `budget_bytes` of locked memory (see the module docstring).

    Pre-flight, before anything is created: the budget against RLIMIT_MEMLOCK, the directory (exists,
    writable, O_DIRECT or a warning), `expected_bytes` against the free space. Stale subdirectories of
    dead processes in `directory` are removed. `close()` removes this space's files.

    `requests_in_flight` is how many requests each queue keeps in the drive at once, on its one aio handle
    (`handle`, if given, is the read queue's and the pool's: requests the caller submits on it themselves
    are theirs to complete with wait_request, and its wait_completed is the queue's to call). One keeps
    requests strictly one after another; two or more keep the drive busy across each request's tail, which
    is what a stream of tiles needs.

    `handle_settings` are the aio_handle settings of every handle the space makes (over the project's
    recommended ones; checked first, a bad one raising ValueError/TypeError naming it).

    `directory=None` makes a read-only space: no swap file and no write queue, only external units (the
    weights streamed for inference are read in place from their checkpoint; nothing is written).

    fork(): a space belongs to the process that made it. In a forked child its reads and writes would wait
    for threads that are not there; `close()` there only marks it closed (the parent's files, directory
    and memory are left alone), so a child makes a space of its own.
    """

    def __init__(self, directory: str | os.PathLike | None, budget_bytes: int, *, handle: Any = None,
                 expected_bytes: int = 0, requests_in_flight: int = 1,
                 handle_settings: Mapping[str, Any] | None = None) -> None:
        budget_bytes = preflight.budget_arg(budget_bytes)
        settings = check_settings(handle_settings or {})  # a bad value fails here, before anything is made
        if (isinstance(requests_in_flight, bool) or not isinstance(requests_in_flight, int)
                or not 1 <= requests_in_flight <= MAX_REQUESTS_IN_FLIGHT):
            raise ValueError(f"requests_in_flight must be an int from 1 to {MAX_REQUESTS_IN_FLIGHT}, got "
                             f"{requests_in_flight!r}")
        preflight.check_memlock(budget_bytes, locked_bytes())
        if directory is not None:
            directory = os.path.abspath(os.fspath(directory))
            preflight.check_writable(directory)
            folders.remove_stale(directory)
            if expected_bytes:
                preflight.check_free_space(directory, expected_bytes)
        self.directory = directory
        self.handle_settings = settings
        self.path = None if directory is None else folders.make_own(directory)
        self.file = None if self.path is None else os.path.join(self.path, SWAP_FILE)
        self._fd = -1
        self._ext: dict[str, int] = {}
        self._units: dict[str, Unit] = {}
        self._extents: Extents | None = None  # the swap file's ranges (none for a read-only space)
        self._pending_writes: list[Ticket] = []
        self.reads = self.writes = None
        self.pid = os.getpid()  # a forked child leaves this space to the process that made it (close())
        self._checks: concurrent.futures.ThreadPoolExecutor | None = None
        self._checks_lock = threading.Lock()
        self._sums: dict[str, int] = {}  # owned unit -> CRC-32 of the bytes last written (read back checked)
        self.pool = None
        self.closed = False
        try:
            if self.file is not None:
                self._fd, self.direct = preflight.open_direct(self.file, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                self._extents = Extents(self._fd, self.file, directory)
            # The pool only allocates through its handle: it shares the read queue's.
            read_handle = handle if handle is not None else new_handle(**settings)
            self.pool = BufferPool(budget_bytes, read_handle)
            self.reads = IOQueue(read_handle, "read", requests_in_flight)
            if self.file is not None:
                self.writes = IOQueue(new_handle(**settings), "write", requests_in_flight)
        except BaseException:
            self.close()
            raise
        _OPEN.add(self)

    # ------------------------------------------------------------------------------------------ units
    def add(self, name: str, nbytes: int) -> Unit:
        """Reserve `nbytes` (padded to pages) in the swap file for a new unit `name`."""
        self._check_open()
        if self.file is None:
            raise RuntimeError(f"unit {name!r}: this swap space is read-only (made without a directory); it "
                               "holds external units only")
        if name in self._units:
            raise ValueError(f"a unit named {name!r} exists already")
        if nbytes <= 0:
            raise ValueError(f"unit {name!r}: nbytes must be positive, got {nbytes}")
        padded = round_up(nbytes)
        if padded > self.pool.capacity:
            raise ValueError(f"unit {name!r} takes {padded} bytes, over budget_bytes={self.pool.capacity}: "
                             f"raise budget_bytes to at least {padded}")
        offset = self._extents.take(padded)  # type: ignore[union-attr] - set with self.file
        unit = Unit(name, self.file, offset, nbytes, True, offset, offset + padded)
        self._units[name] = unit
        return unit

    def remove(self, unit: Unit) -> None:
        """Forget the owned `unit` and give its range of the swap file back (its drive space is released;
        a later unit may take the range). Queued writes finish first: none may land in a range reused."""
        self._check_open()
        if not unit.owned or self._units.get(unit.name) is not unit:
            raise ValueError(f"unit {unit.name!r} is not an owned unit of this swap space")
        self.wait_writes()
        del self._units[unit.name]
        with self._checks_lock:
            self._sums.pop(unit.name, None)
        self._extents.give(unit.io_start, unit.io_nbytes)  # type: ignore[union-attr] - owned: set

    def add_external(self, name: str, path: str | os.PathLike, offset: int, nbytes: int, *,
                     pool: BufferPool | None = None) -> Unit:
        """A read-only unit: `nbytes` at `offset` of an existing file (e.g. a safetensors tensor), to be
        read into `pool` when given (its size is checked against that pool's)."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        if name in self._units:
            raise ValueError(f"a unit named {name!r} exists already")
        if offset < 0 or nbytes <= 0:
            raise ValueError(f"unit {name!r}: offset must be >= 0 and nbytes > 0, got {offset}, {nbytes}")
        fd = self._ext.get(path)
        if fd is None:
            fd = self._ext[path] = preflight.open_direct(path, os.O_RDONLY)[0]
        size = os.fstat(fd).st_size
        if offset + nbytes > size:
            raise ValueError(f"unit {name!r}: bytes [{offset}, {offset + nbytes}) lie past the end of {path} "
                             f"({size} bytes)")
        start = offset // PAGE * PAGE
        end = max(offset + nbytes, min(round_up(offset + nbytes), size))
        unit = Unit(name, path, offset, nbytes, False, start, end)
        capacity = (self.pool if pool is None else pool).capacity
        if round_up(unit.io_nbytes) > capacity:
            raise ValueError(f"unit {name!r} takes {round_up(unit.io_nbytes)} bytes, more than "
                             f"budget_bytes={capacity}: raise budget_bytes to at least that")
        self._units[name] = unit
        return unit

    def unit(self, name: str) -> Unit:
        """The unit called `name` (KeyError naming it if none)."""
        try:
            return self._units[name]
        except KeyError:
            raise KeyError(f"no unit named {name!r} in this swap space") from None

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the swap file reserved for owned units (ranges given back not counted)."""
        return 0 if self._extents is None else self._extents.end - self._extents.free_bytes

    def check_files(self) -> None:
        """Raise OSError naming the swap file if it was deleted or cut short under this space."""
        self._check_open()
        if self.file is None:
            return
        st = os.fstat(self._fd)
        if st.st_nlink == 0:
            raise OSError(errno.ENOENT, "the swap file was deleted while in use; its state is lost (load a "
                          "checkpoint into a new optimizer)", self.file)
        if self._extents is not None and st.st_size < self._extents.end:
            raise OSError(errno.EIO, f"the swap file holds {st.st_size} bytes, {self._extents.end} written: "
                          "it was truncated while in use; its state is lost (load a checkpoint)", self.file)

    # ------------------------------------------------------------------------------------------ moves
    def allocate(self, units: Sequence[Unit], block: bool = True, *,
                 pool: BufferPool | None = None, within: tuple[int, int] | None = None) -> Lease | None:
        """Pool memory for `units` without reading them (their contents are about to be written); from
        `pool` instead of the space's own when given (a cache that keeps its memory apart), between the
        pool offsets `within` when there is room there (BufferPool.acquire)."""
        self._check_open()
        buf = (self.pool if pool is None else pool).acquire(Lease.size_of(units), block, within=within)
        return None if buf is None else Lease(self, units, buf)

    def read(self, units: Sequence[Unit], *, block: bool = True, demand: bool = False,
             check: Callable[[Lease], None] | None = None,
             pool: BufferPool | None = None, parts: int = 1,
             within: tuple[int, int] | None = None) -> Lease | None:
        """Queue reads of `units` into pool memory (`pool`'s when given, between its offsets `within` when
        there is room there); None when `block` is False and the pool has no room. `parts` cuts each run of
        units into that many requests (see Lease.runs).

        `check(lease)` runs on the space's check thread once every read of the lease has succeeded: a
        checksum computed there overlaps the caller's work and the next reads (run on the read queue's
        completing thread, the drive would idle while it is computed); `lease.wait()` returns once it has,
        and raises what it raises."""
        lease = self.allocate(units, block, pool=pool, within=within)
        if lease is None:
            return None
        priority = DEMAND if demand else PREFETCH
        check = self._with_sums(lease, check)
        runs = lease.runs(lease.units, parts)
        left = [len(runs)]
        count = threading.Lock()  # runs complete on either of the queue's threads
        if check is not None:
            lease.checked = concurrent.futures.Future()

        def done(ticket: Ticket) -> None:
            with count:
                left[0] -= 1
                last = left[0] == 0
            if last and lease.checked is not None:
                if all(t.error is None for t in lease.tickets) and check is not None:
                    run_check(self._checker(), lease.checked, lambda: check(lease))
                else:
                    lease.checked.set_result(None)  # nothing to check: wait() raises the read's error

        for view, start, path in runs:
            fd = self._fd if path == self.file else self._ext[path]
            lease.tickets.append(Ticket(view, fd, start, path, False, done))
        for t in lease.tickets:
            self.reads.submit(t, priority)
        return lease

    def record_sums(self, lease: Lease, units: Sequence[Unit]) -> None:
        """Remember the CRC-32 of each of `units`' bytes as `lease` wrote them (the whole page range written;
        taken before its writes' waiters are released), so that the next read of the unit is checked
        against it."""
        sums = {u.name: crc32(lease.io_view(u).numpy()) for u in units}
        with self._checks_lock:
            self._sums.update(sums)

    def _with_sums(self, lease: Lease,
                   check: Callable[[Lease], None] | None) -> Callable[[Lease], None] | None:
        """`check`, preceded by the check of every unit of `lease` written by this space against the CRC-32
        it was written with: a byte changed on the drive (or in the file) raises OSError EIO naming the
        file and the unit instead of being used."""
        with self._checks_lock:
            expected = [(u, self._sums[u.name]) for u in lease.units if u.name in self._sums]
        if not expected:
            return check

        def verify(done: Lease) -> None:
            for u, crc in expected:
                got = crc32(done.io_view(u).numpy())
                if got != crc:
                    raise OSError(errno.EIO, f"swapped unit {u.name!r} ({u.io_nbytes} bytes at offset "
                                  f"{u.io_start}) read back with CRC-32 {got:#010x}, written with "
                                  f"{crc:#010x}: the file or the drive changed it", u.path)
            if check is not None:
                check(done)

        return verify

    def _checker(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread checks of read bytes run on, started on first use."""
        with self._checks_lock:
            if self._checks is None:
                self._checks = check_runner()
            return self._checks

    def _track_write(self, ticket: Ticket) -> None:
        self._pending_writes = [t for t in self._pending_writes if not t.done() or t.error is not None]
        self._pending_writes.append(ticket)

    def wait_writes(self) -> None:
        """Wait for every queued write; raise the first error among them."""
        pending, self._pending_writes = self._pending_writes, []
        for t in pending:
            t.settle()
        for t in pending:
            t.raise_error()

    def _check_open(self) -> None:
        if self.pid != os.getpid():
            raise RuntimeError(f"this swap space was made by process {self.pid}, before fork(): its I/O "
                               "threads stayed there; make a new one in this process")
        if self.closed:
            raise RuntimeError(f"the swap space in {self.directory or '(read-only)'} is closed")

    def close(self) -> None:
        """Finish queued I/O, free the pool, close files, remove this space's subdirectory (idempotent)."""
        if getattr(self, "closed", True):  # closed, or __init__ failed before there was anything to close
            return
        self.closed = True
        if self.pid != os.getpid():
            # A forked child's copy: its threads stayed in the parent (their locks may be held for good), its
            # handles refuse work, and its directory and files are the parent's, still in use there.
            return
        for q in (self.reads, self.writes):
            if q is not None:
                q.close()
        if self._checks is not None:  # after the reads: their completions hand it checks
            self._checks.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()
        for fd in [self._fd, *self._ext.values()]:
            if fd >= 0:
                os.close(fd)
        self._fd = -1
        self._ext.clear()
        if getattr(self, "path", None) is not None:
            folders.remove_own(self.path)



class ReadAhead:
    """Leases of `groups` (lists of units), issued in order as far ahead as the pool allows.

    `take(i)` must be called for i = 0, 1, ... in order; it issues group i (waiting for pool room if
    needed), demands it, waits for it, issues more groups ahead without blocking, and returns the lease
    (None for an empty group). The caller writes back or releases each lease; `close()` releases those
    issued but never taken.

    `end_parts` cuts the reads of the first and the last group into that many requests, so that they fill
    every slot of the read queue (a walk that is a pipeline starts sooner on the first group, and the last one
    no longer completes together with the one before it, behind which its update and write-back would
    wait). `check` is handed to every read (SwapSpace.read). With `cyclic`, the sequence repeats without end:
    position i is group i % len(groups) (the layers of a model, forward after forward), so reads for the
    next pass start while the last groups of this one are in use; at most one pass is in flight, and
    `recycle(i, lease)` hands a used lease back for position i + len(groups) (same units, bytes still in
    memory) when the budget holds a whole pass, so nothing is read twice. `restart(i)` drops what was
    issued ahead (the caller left the expected order, e.g. a forward interrupted halfway) and goes on from
    position i.
    """

    def __init__(self, space: SwapSpace, groups: Sequence[Sequence[Unit]], ahead: bool = True, *,
                 cyclic: bool = False, check: Callable[[Lease], None] | None = None,
                 end_parts: int = 1) -> None:
        self.space, self.groups, self.ahead, self.cyclic = space, list(groups), ahead, cyclic
        self.check = check
        self.end_parts = end_parts
        if cyclic and not self.groups:
            raise ValueError("a cyclic ReadAhead needs at least one group")
        self._issued: dict[int, Lease | None] = {}
        self._next = 0
        self._low = 0  # the first position not taken yet

    def _group(self, i: int) -> Sequence[Unit]:
        return self.groups[i % len(self.groups)] if self.cyclic else self.groups[i]

    def _parts(self, i: int) -> int:
        """Requests for the reads of position i: `end_parts` for the first and last groups of a walk."""
        return self.end_parts if not self.cyclic and i in (0, len(self.groups) - 1) else 1

    def ready(self, i: int) -> bool:
        """Whether position i was issued and every read of it has finished (take(i) would not wait)."""
        lease = self._issued.get(i)
        return i in self._issued and (lease is None or lease.done())

    def pump(self) -> None:
        """Issue the next groups while the pool has room (never waits)."""
        while self.ahead and (self._next < self._low + len(self.groups) - 1 if self.cyclic
                              else self._next < len(self.groups)):
            units = self._group(self._next)
            lease = (self.space.read(units, block=False, check=self.check, parts=self._parts(self._next))
                     if units else None)
            if units and lease is None:
                return
            self._issued[self._next] = lease
            self._next += 1

    def take(self, i: int) -> Lease | None:
        if i not in self._issued:
            if i != self._next:
                raise ValueError(f"ReadAhead.take({i}) out of order (next is {self._next})")
            units = self._group(i)
            self._issued[i] = (self.space.read(units, demand=True, check=self.check, parts=self._parts(i))
                               if units else None)
            self._next += 1
        lease = self._issued.pop(i)
        self._low = i + 1
        if lease is not None:
            lease.demand()
        self.pump()
        if lease is not None:
            try:
                lease.wait()
            except BaseException:
                lease.release()
                raise
        return lease

    def restart(self, i: int) -> None:
        """Release every lease issued but not taken; the next take is take(i)."""
        self.close()
        self._next = self._low = i

    def recycle(self, i: int, lease: Lease | None) -> bool:
        """Keep the taken lease of position i as position i + len(groups) when that is the next to issue
        (cyclic only); False when it is not (the caller releases the lease)."""
        if not self.cyclic or i + len(self.groups) != self._next:
            return False
        self._issued[self._next] = lease
        self._next += 1
        return True

    def close(self) -> None:
        for lease in self._issued.values():
            if lease is not None:
                lease.release()
        self._issued.clear()
