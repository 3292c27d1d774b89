"""One direction of the swap space's I/O: a queue served by threads with an aio handle each.

Why threads doing one synchronous request at a time each: the handle's `wait()` completes every request
queued on it, so waiting for one tensor through it would drain all the others. Here each request is one
`sync_pread`/`sync_pwrite` (the handle still splits it over its own worker threads and queue depth), and
completes its own ticket: waiting for one tensor never waits for another, and since reads and writes have
separate threads and handles, a write-back never delays the next read. A queue given more than one handle
serves as many requests at once, one per handle: the next request is already in the drive while the last
blocks of the previous one complete, instead of the drive idling at each request's tail. A request not yet
started can be promoted: demanded reads are served before queued prefetches (the heap orders by priority,
then by submission). Checks of the bytes read (CRC-32s) run on a thread of their own (check_runner),
beside the reads.
"""

from __future__ import annotations

import concurrent.futures
import errno
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

DEMAND, PREFETCH = 0, 1


class Ticket:
    """One request: `tensor` (uint8, locked) to or from `fd` at `offset`; completion is per ticket.

    `began` and `ended` are the time.perf_counter() at which a queue thread started and finished the
    transfer (0.0 until then): what a profile of the pipeline reads.
    """

    __slots__ = ("_done", "began", "ended", "error", "fd", "offset", "on_done", "path", "priority", "started",
                 "tensor", "write")

    def __init__(self, tensor: Any, fd: int, offset: int, path: str, write: bool,
                 on_done: Callable[[Ticket], None] | None = None) -> None:
        self.tensor, self.fd, self.offset, self.path, self.write = tensor, fd, offset, path, write
        self.on_done = on_done
        self.error: BaseException | None = None
        self.priority = PREFETCH
        self.started = False
        self.began = self.ended = 0.0
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
    """Requests of one direction, started in order of (priority, submission) by one thread per handle.

    `handle` serves requests one at a time; each of `more_handles` adds a thread serving one more at once
    (their `on_done` callbacks may then run on different threads concurrently).
    """

    def __init__(self, handle: Any, name: str, more_handles: Sequence[Any] = ()) -> None:
        self._heap: list[tuple[int, int, Ticket]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._serve, args=(h,), name=f"deepnvme-offload-{name}-{i}",
                                          daemon=True) for i, h in enumerate([handle, *more_handles])]
        for t in self._threads:
            t.start()

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

    def _serve(self, handle: Any) -> None:
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
            ticket.began = time.perf_counter()
            try:
                if ticket.write:
                    handle.sync_pwrite(ticket.tensor, ticket.fd, ticket.offset)
                else:
                    handle.sync_pread(ticket.tensor, ticket.fd, ticket.offset)
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
                ticket.ended = time.perf_counter()
                if ticket.on_done is not None:
                    try:
                        ticket.on_done(ticket)
                    except BaseException as exc:  # noqa: BLE001
                        ticket.error = ticket.error or exc
                ticket._done.set()

    def close(self) -> None:
        """Finish what is queued, then stop the threads; a finished thread drops its handle, so the
        descriptors close now, not when a reference cycle around the owner is collected."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


def check_runner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread a swap space runs its checks of read bytes on (CRC-32s), in submission order.

    Why not on the read thread that completed the reads: a CRC-32 of a 50 MB unit takes milliseconds of
    CPU, and a read thread computing it starts no request meanwhile, so the drive idles for every check;
    here the next read is in flight while the last one is checked.
    """
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deepnvme-offload-check")


def run_check(runner: concurrent.futures.Executor, result: concurrent.futures.Future[None],
              fn: Callable[[], None]) -> None:
    """Run `fn` on `runner` and settle `result` with its outcome (made before the reads it checks were
    queued, so that waiters can hold it already); inline when the runner is shut down, so no waiter hangs."""

    def settle() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, never lost in the runner
            result.set_exception(exc)
        else:
            result.set_result(None)

    try:
        runner.submit(settle)
    except RuntimeError:  # shut down: closing
        settle()
