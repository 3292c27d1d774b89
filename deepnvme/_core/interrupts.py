"""Ctrl-C inside torch's callbacks, seen for what it is: save and load call torch.save and torch.load with a
stream of ours, whose write and readinto torch's C++ calls. A KeyboardInterrupt raised there comes back
wrapped in an error of torch's own (or replaced by one), which would read as a failed write or a damaged
file; these two find it again."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def interrupts_noted() -> Iterator[list[BaseException]]:
    """Collect what the SIGINT handler raises meanwhile (on the main thread, where a Python handler is
    installed: Python's own, which raises KeyboardInterrupt, or the program's; else the list stays empty).

    Why: torch's C++ calls the stream's readinto and write. A Ctrl-C that lands as one of them begins,
    before any of its code runs, escapes into torch, whose reader then tries another method and replaces
    the exception with an AttributeError of its own, chaining nothing: the load would call a good file
    damaged. The installed handler is wrapped for the duration, so what it raises is noted before it is
    raised and the caller can raise that instead.
    """
    noted: list[BaseException] = []
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield noted
        return

    def note(signum: int, frame: Any) -> Any:
        try:
            return handler(signum, frame)
        except BaseException as exc:
            noted.append(exc)
            raise

    try:
        signal.signal(signal.SIGINT, note)  # inside the try: an interrupt right after it still restores
        yield noted
    finally:
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, handler)


def interruption(exc: BaseException) -> BaseException | None:
    """A KeyboardInterrupt or SystemExit among what led to `exc`, if any. One raised inside a callback of
    torch's C++ (a stream's write or readinto) comes back wrapped in an error of torch's own (a RuntimeError,
    or an AttributeError when its reader falls back to another method), which would read as a damaged file
    or a failed write: the interruption is what happened."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, (KeyboardInterrupt, SystemExit)):
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None
