"""Helpers for the tests that drive one handle from several threads, or wait for what another thread does."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def run_threads(targets: list[Callable[[], None]], timeout: float = 120.0) -> None:
    """Run callables in threads started together; fail on any exception or a thread still alive."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait()
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def wait_until(condition: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Poll `condition` until it holds: for a test that must wait for an event it cannot be told of (bytes
    that land, a file that appears), never a fixed sleep that a busy machine may overrun. `limit` only turns
    a hang into a failure naming `what`."""
    give_up = time.monotonic() + limit
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"waited {limit:.0f} s for {what}")
        time.sleep(0.001)
