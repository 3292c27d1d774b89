"""One direction of the swap space's I/O: a queue of requests kept in flight on one aio handle.

Each request is one `submit_pread`/`submit_pwrite` on the handle (which splits it over its own worker
threads and queue depth) and has its own ticket: the handle completes requests one at a time
(`wait_completed`, `wait_request`), so waiting for one tensor never waits for another, and since reads and
writes have a handle and a queue each, a write-back never delays the next read. Up to `in_flight`
requests are in the drive at once, so the next one is already there while the last blocks of the previous
one complete, instead of the drive idling at each request's tail. A request not yet issued can be
promoted: demanded reads are issued before queued prefetches (the heap orders by priority, then by
submission). One thread per queue completes what the handle reports done and issues the next request;
`submit` issues at once when a slot is free. Checks of the bytes read (CRC-32s) run on a thread of their
own (check_runner), beside the reads.
"""

from __future__ import annotations

import concurrent.futures
import errno
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

DEMAND, PREFETCH = 0, 1
#: How long the completing thread waits for the handle at a time: it is woken by completions, so this only
#: bounds how late it notices that the process is shutting down around it.
_POLL_S = 1.0


class Ticket:
    """One request: `tensor` (uint8, locked) to or from `fd` at `offset`; completion is per ticket.

    `began` and `ended` are the time.perf_counter() at which the request was issued to the handle and
    found completed (0.0 until then): what a profile of the pipeline reads. `on_done` runs on the queue's
    thread before waiters are released; it should be quick (it delays the completion of the requests
    behind it, not their transfer).
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

    def fail(self, exc: BaseException) -> None:
        """Record the handle's error for this request as the error its waiter gets: an OSError naming the
        file, with the errno (a read past the end of the file, the handle's ValueError, is EIO: the file was
        cut short under the space)."""
        if isinstance(exc, OSError):
            code = exc.errno if exc.errno is not None else errno.EIO
            what = "writing" if self.write else "reading"
            self.error = OSError(code, f"{os.strerror(code)} ({what} {self.tensor.numel()} bytes at offset "
                                 f"{self.offset})", self.path)
        elif isinstance(exc, ValueError):
            self.error = OSError(errno.EIO, f"{exc}", self.path)
        else:
            self.error = exc


class IOQueue:
    """Requests of one direction, issued on `handle` in order of (priority, submission), at most
    `in_flight` at once, each completed on its own by the queue's one thread.

    `on_done` callbacks run on that thread, one at a time.
    """

    def __init__(self, handle: Any, name: str, in_flight: int = 1) -> None:
        self._handle = handle
        self._in_flight = in_flight
        self._heap: list[tuple[int, int, Ticket]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._issued: dict[int, Ticket] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._complete, name=f"deepnvme-offload-{name}", daemon=True)
        self._thread.start()

    def submit(self, ticket: Ticket, priority: int = PREFETCH) -> Ticket:
        """Queue `ticket` (issued at once while fewer than `in_flight` are in the drive); returns it."""
        with self._cond:
            if self._stop:
                raise RuntimeError("the swap space is closed")
            ticket.priority = priority
            heapq.heappush(self._heap, (priority, next(self._seq), ticket))
            failed = self._issue()
            self._cond.notify()
        self._finish_all(failed)
        return ticket

    def demand(self, ticket: Ticket) -> None:
        """Issue `ticket` before every queued prefetch (no effect once it has been issued)."""
        with self._cond:
            if ticket.started or ticket.priority == DEMAND or ticket.done():
                return
            ticket.priority = DEMAND
            # The old heap entry stays and is skipped when popped (the ticket has started by then).
            heapq.heappush(self._heap, (DEMAND, next(self._seq), ticket))

    def _issue(self) -> list[Ticket]:
        """Issue queued tickets while slots are free (the lock held); those the handle refused at once (a
        bad descriptor, a read past the end of the file), to be finished outside the lock."""
        failed = []
        while self._heap and len(self._issued) < self._in_flight:
            ticket = heapq.heappop(self._heap)[2]
            if ticket.started:
                continue
            ticket.started = True
            ticket.began = time.perf_counter()
            submit = self._handle.submit_pwrite if ticket.write else self._handle.submit_pread
            try:
                self._issued[submit(ticket.tensor, ticket.fd, ticket.offset)] = ticket
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                ticket.fail(exc)
                failed.append(ticket)
        return failed

    def _complete(self) -> None:
        """The queue's thread: wait for the handle to report requests done, finish their tickets, issue more;
        after close(), until nothing is queued or in flight."""
        while True:
            with self._cond:
                while not self._issued and not (self._stop and not self._heap):
                    if self._heap:  # slots free (nothing issued): issue, outside a wait
                        break
                    self._cond.wait()
                if not self._issued and not self._heap:
                    return
                failed = self._issue()
            self._finish_all(failed)
            try:
                ids = self._handle.wait_completed(_POLL_S) if self._issued else []
            except BaseException as exc:  # noqa: BLE001 - never strand a waiter: every issued request fails
                with self._cond:
                    lost, self._issued = list(self._issued.values()), {}
                for ticket in lost:
                    ticket.fail(exc)
                self._finish_all(lost)
                continue
            for rid in ids:
                with self._cond:
                    ticket = self._issued.pop(rid)
                try:
                    self._handle.wait_request(rid)  # hands the request over: returns at once
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter, never lost in this thread
                    ticket.fail(exc)
                ticket.ended = time.perf_counter()
                with self._cond:  # the next request goes into the drive before this one's callback runs
                    failed = self._issue()
                self._finish_all(failed)
                self._finish(ticket)

    def _finish_all(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            ticket.ended = time.perf_counter()
            self._finish(ticket)

    @staticmethod
    def _finish(ticket: Ticket) -> None:
        if ticket.on_done is not None:
            try:
                ticket.on_done(ticket)
            except BaseException as exc:  # noqa: BLE001
                ticket.error = ticket.error or exc
        ticket._done.set()

    def close(self) -> None:
        """Finish what is queued and in flight, then stop the thread and drop the handle, so that its
        descriptors close now, not when a reference cycle around the owner is collected."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._handle = None


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
