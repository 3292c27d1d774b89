"""One direction of the swap space's I/O: a queue of requests kept in flight on one aio handle.

Each request is one `submit_pread`/`submit_pwrite` on the handle (which splits it over its own worker
threads and queue depth) and has its own ticket: the handle completes requests one at a time
(`wait_completed`, `wait_request`), so waiting for one tensor never waits for another, and since reads and
writes have a handle and a queue each, a write-back never delays the next read. Up to `in_flight`
requests are in the drive at once, so the next one is already there while the last blocks of the previous
one complete, instead of the drive idling at each request's tail. A request not yet issued can be
promoted: demanded reads are issued before queued prefetches (the heap orders by priority, then by
submission).

Two threads per queue, whatever `in_flight` is: one issues requests as slots free up, one completes what
the handle reports done. Why not issue from the caller's thread: a Ctrl-C (or any signal handler's
exception) there could land between the handle taking a request and the queue recording its id, leaving
a request in flight that no ticket owns while its buffer goes back to the pool; Python runs signal
handlers on the main thread only, so these two threads are never interrupted that way. Checks of the bytes
read (CRC-32s) run on a thread of their own (check_runner), beside the reads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import errno
import heapq
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

DEMAND, PREFETCH = 0, 1
#: How long the completing thread waits for the handle at a time: completions wake it, so this only bounds
#: how late it notices that the handle failed to wait.
_POLL_S = 1.0


class Ticket:
    """One request: `tensor` (uint8, locked) to or from `fd` at `offset`; completion is per ticket.

    `queued`, `began` and `ended` are the time.perf_counter() at which the request was submitted to its
    queue, issued to the handle and found completed (0.0 until then): what a profile of the pipeline
    reads. `on_done` runs on one of the queue's threads before waiters are released, and the request
    holds its slot until it returns: it should be quick.
    """

    __slots__ = ("_done", "began", "ended", "error", "fd", "offset", "on_done", "path", "priority", "queued",
                 "started", "tensor", "write")

    def __init__(self, tensor: Any, fd: int, offset: int, path: str, write: bool,
                 on_done: Callable[[Ticket], None] | None = None) -> None:
        self.tensor, self.fd, self.offset, self.path, self.write = tensor, fd, offset, path, write
        self.on_done = on_done
        self.error: BaseException | None = None
        self.priority = PREFETCH
        self.started = False
        self.queued = self.began = self.ended = 0.0
        self._done = threading.Event()

    def done(self) -> bool:
        """Whether the request has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> None:
        """Wait for this request only; raise its error (an OSError naming the file)."""
        self._done.wait()
        self.raise_error()

    def raise_error(self) -> None:
        """Raise this request's error, if any: a copy each time, so that the one the ticket keeps never
        holds the frames of a raise (they reach the model, and through the ticket would keep it alive)."""
        exc = self.error
        if exc is None:
            return
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, exc.filename)
        raise copy.copy(exc)

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
    `in_flight` at once (a request's slot is free again once its `on_done` has returned), each completed
    on its own. See the module docstring for the two threads.

    The caller's side (`submit`, `demand`) only posts a message to the issuing thread's inbox, a
    queue.SimpleQueue, whose put is one C call: a signal handler raising in the caller (Ctrl-C) lands
    before or after it, never inside a lock that the queue's threads would then wait for forever (a
    `with lock:` is not safe against that in CPython). The heap and the count of busy slots belong to
    the issuing thread alone.

    `handle` is the queue's alone as far as completion goes: ids its `wait_completed` reports that the
    queue did not issue are left to whoever did (their `wait_request` still hands them over).
    """

    def __init__(self, handle: Any, name: str, in_flight: int = 1) -> None:
        self._handle = handle
        self._in_flight = in_flight
        self._inbox: queue.SimpleQueue[tuple[str, Ticket | None]] = queue.SimpleQueue()
        self._cond = threading.Condition()  # the two threads' only: issued requests, and whether issuing
        self._issued: dict[int, Ticket] = {}
        self._issuing = True  # False once closing and nothing is left to issue
        self._stop = False
        self._closed = False  # close() has returned: a late submit() finishes its ticket itself
        self._heap: list[tuple[int, int, Ticket]] = []  # the issuing thread's alone
        self._threads = [threading.Thread(target=fn, name=f"deepnvme-offload-{name}-{role}", daemon=True)
                         for fn, role in ((self._issue_loop, "issue"), (self._complete_loop, "complete"))]
        for t in self._threads:
            t.start()

    def submit(self, ticket: Ticket, priority: int = PREFETCH) -> Ticket:
        """Queue `ticket`; returns it."""
        if self._stop:
            raise RuntimeError("the swap space is closed")
        ticket.priority = priority
        ticket.queued = time.perf_counter()
        self._inbox.put(("submit", ticket))
        if self._closed:  # close() ran to its end meanwhile: no thread reads the inbox any more
            self._refuse_late()
        return ticket

    def demand(self, ticket: Ticket) -> None:
        """Issue `ticket` before every queued prefetch (no effect once it has been issued)."""
        if not (ticket.started or ticket.priority == DEMAND or ticket.done()):
            self._inbox.put(("demand", ticket))

    def _issue_loop(self) -> None:
        heap = self._heap
        seq = itertools.count()
        busy = 0  # issued and not yet finished (its on_done not yet returned)
        stopping = False
        try:
            while not (stopping and not heap and busy == 0):
                messages = [self._inbox.get()] if not heap or busy >= self._in_flight else []
                with contextlib.suppress(queue.Empty):
                    while True:  # all that is waiting, so that a demand counts before the next issue
                        messages.append(self._inbox.get_nowait())
                for kind, ticket in messages:
                    if kind == "freed":
                        busy -= 1
                    elif kind == "stop":
                        stopping = True
                    elif kind == "submit" or (kind == "demand" and not ticket.started
                                              and ticket.priority != DEMAND):
                        if kind == "demand":
                            ticket.priority = DEMAND  # the old heap entry stays; skipped once started
                        heapq.heappush(heap, (ticket.priority, next(seq), ticket))
                while heap and busy < self._in_flight:
                    ticket = heapq.heappop(heap)[2]
                    if not ticket.started:
                        busy += self._issue(ticket)
        finally:
            with self._cond:
                self._issuing = False
                self._cond.notify_all()
            self._refuse_late()  # and, were this thread to die, what it held

    def _issue(self, ticket: Ticket) -> int:
        """Issue `ticket` on the handle: 1 (a slot taken), or 0 when the handle refused it at once (a bad
        descriptor, a read past the end of the file), the ticket then finished with that error."""
        ticket.started = True
        ticket.began = time.perf_counter()
        submit = self._handle.submit_pwrite if ticket.write else self._handle.submit_pread
        with self._cond:  # the completing thread looks an id up only once it is recorded here
            try:
                self._issued[submit(ticket.tensor, ticket.fd, ticket.offset)] = ticket
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                ticket.fail(exc)
            else:
                self._cond.notify_all()
                return 1
        self._finish(ticket)
        return 0

    def _refuse_late(self) -> None:
        """Tickets submitted while close() ran (or left queued by an issuing thread that died): finished with
        the error submit() gives after close()."""
        late = [entry[2] for entry in self._heap]
        self._heap.clear()
        with contextlib.suppress(queue.Empty):
            while True:
                kind, ticket = self._inbox.get_nowait()
                if kind == "submit":
                    late.append(ticket)
        for ticket in late:
            if not ticket.started:
                ticket.started = True
                ticket.error = RuntimeError("the swap space is closed")
                self._finish(ticket)

    def _complete_loop(self) -> None:
        while True:
            with self._cond:
                while not self._issued:
                    if not self._issuing:
                        return
                    self._cond.wait()
            try:
                ids = self._handle.wait_completed(_POLL_S)
            except Exception:  # noqa: BLE001 - then wait for each request in flight on its own
                ids = None
            if not ids:
                # Nothing reported for a while: a request of ours may have been reported to someone else
                # calling wait_completed on a shared handle; request_done still tells.
                with self._cond:
                    ids = [rid for rid in self._issued if ids is None or self._done_elsewhere(rid)]
            for rid in ids:
                with self._cond:
                    ticket = self._issued.pop(rid, None)
                if ticket is None:  # not this queue's request
                    continue
                try:
                    self._handle.wait_request(rid)  # hands the request over (at once, when reported done)
                except Exception as exc:  # noqa: BLE001 - handed to the waiter, never lost in this thread
                    ticket.fail(exc)
                self._finish(ticket)
                self._inbox.put(("freed", None))

    def _done_elsewhere(self, rid: int) -> bool:
        """Whether request `rid` has finished though wait_completed did not say so (True when the handle
        no longer knows it: wait_request then raises, and the ticket gets that error)."""
        try:
            return bool(self._handle.request_done(rid))
        except Exception:  # noqa: BLE001
            return True

    @staticmethod
    def _finish(ticket: Ticket) -> None:
        """Run `ticket`'s callback, then release its waiters."""
        ticket.ended = time.perf_counter()
        if ticket.on_done is not None:
            try:
                ticket.on_done(ticket)
            except BaseException as exc:  # noqa: BLE001
                ticket.error = ticket.error or exc
        ticket._done.set()

    def close(self) -> None:
        """Finish what is queued and in flight, then stop the threads and drop the handle, so that its
        descriptors close now, not when a reference cycle around the owner is collected. A submit() racing
        it finishes its ticket with RuntimeError (here, or in submit() itself once this has returned)."""
        self._stop = True
        self._inbox.put(("stop", None))
        for t in self._threads:
            t.join()
        self._handle = None
        self._closed = True
        self._refuse_late()


def check_runner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread a swap space runs its checks of read bytes on (CRC-32s), in submission order.

    Why not on the read queue's completing thread: a CRC-32 of a 50 MB unit takes milliseconds of CPU, and
    the request holds its slot while its callback runs, so the drive would idle for every check;
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
