"""Helpers for the tests that drive one handle from several threads."""

from __future__ import annotations

import threading
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
