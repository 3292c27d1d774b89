"""One direction of the swap space's I/O: a queue served by a thread with an aio handle of its own.

Why a thread per direction, each doing one synchronous request at a time: the handle's `wait()` completes
every request queued on it, so waiting for one tensor through it would drain all the others. Here each
request is one `sync_pread`/`sync_pwrite` (the handle still splits it over its own worker threads and
queue depth), and completes its own ticket: waiting for one tensor never waits for another, and since reads
and writes have separate threads and handles, a write-back never delays the next read. A request not yet
started can be promoted: demanded reads are served before queued prefetches (the heap orders by priority,
then by submission).
"""

from __future__ import annotations

import errno
import heapq
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

DEMAND, PREFETCH = 0, 1


class Ticket:
    """One request: `tensor` (uint8, locked) to or from `fd` at `offset`; completion is per ticket."""

    __slots__ = ("_done", "error", "fd", "offset", "on_done", "path", "priority", "started", "tensor",
                 "write")

    def __init__(self, tensor: Any, fd: int, offset: int, path: str, write: bool,
                 on_done: Callable[[Ticket], None] | None = None) -> None:
        self.tensor, self.fd, self.offset, self.path, self.write = tensor, fd, offset, path, write
        self.on_done = on_done
        self.error: BaseException | None = None
        self.priority = PREFETCH
        self.started = False
        self._done = threading.Event()

    def done(self) -> bool:
        """Whether the request has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> None:
        """Wait for this request only; raise its error (an OSError naming the file)."""
        self._done.wait()
        if self.error is not None:
            raise self.error

    def settle(self) -> None:
        """Wait for this request, ignoring its error (used when unwinding after another error)."""
        self._done.wait()


class IOQueue:
    """Requests of one direction, served in order of (priority, submission) by one thread."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._heap: list[tuple[int, int, Ticket]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name=f"deepnvme-offload-{name}", daemon=True)
        self._thread.start()

    def submit(self, ticket: Ticket, priority: int = PREFETCH) -> Ticket:
        """Queue `ticket`; returns it."""
        with self._cond:
            if self._stop:
                raise RuntimeError("the swap space is closed")
            ticket.priority = priority
            heapq.heappush(self._heap, (priority, next(self._seq), ticket))
            self._cond.notify()
        return ticket

    def demand(self, ticket: Ticket) -> None:
        """Serve `ticket` before every queued prefetch (no effect once it has started)."""
        with self._cond:
            if ticket.started or ticket.priority == DEMAND or ticket.done():
                return
            ticket.priority = DEMAND
            # The old heap entry stays and is skipped when popped (the ticket has started by then).
            heapq.heappush(self._heap, (DEMAND, next(self._seq), ticket))
            self._cond.notify()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._stop:
                    self._cond.wait()
                if not self._heap:
                    return
                ticket = heapq.heappop(self._heap)[2]
                if ticket.started:
                    continue
                ticket.started = True
            try:
                if ticket.write:
                    self._handle.sync_pwrite(ticket.tensor, ticket.fd, ticket.offset)
                else:
                    self._handle.sync_pread(ticket.tensor, ticket.fd, ticket.offset)
            except OSError as exc:
                code = exc.errno if exc.errno is not None else errno.EIO
                what = "writing" if ticket.write else "reading"
                ticket.error = OSError(code, f"{os.strerror(code)} ({what} {ticket.tensor.numel()} bytes at "
                                       f"offset {ticket.offset})", ticket.path)
            except ValueError as exc:  # the handle's "read past end of file": the file was cut short
                ticket.error = OSError(errno.EIO, f"{exc}", ticket.path)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, never lost in this thread
                ticket.error = exc
            finally:
                if ticket.on_done is not None:
                    try:
                        ticket.on_done(ticket)
                    except BaseException as exc:  # noqa: BLE001
                        ticket.error = ticket.error or exc
                ticket._done.set()

    def close(self) -> None:
        """Finish what is queued, then stop the thread and let the handle go (its descriptors close now,
        not when a reference cycle around the owner is collected)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._handle = None
