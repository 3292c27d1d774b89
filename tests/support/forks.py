"""Waiting for a forked child with a deadline, for tests (and their child scripts) that fork: a child that
hangs is killed and fails the test instead of hanging it. No imports beyond the standard library, so a
child script can use it too."""

from __future__ import annotations

import os
import signal
import time


def reap_child(pid: int, seconds: float = 60.0, poll_s: float = 0.01) -> int:
    """Wait at most `seconds` for child `pid` and return its exit code; kill it and raise AssertionError
    when it is still running then."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child {pid} hung (> {seconds} s)")
        time.sleep(poll_s)
