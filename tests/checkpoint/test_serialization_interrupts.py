"""Ctrl-C during deepnvme.load and deepnvme.save leaks no descriptor and leaves no temporary file.

CPython runs a signal's Python handler (KeyboardInterrupt for SIGINT) at the first check after a C call
returns; a SIGINT that arrives while a system call runs (open(2) most of all: it takes the longest) is
raised right there, and a descriptor the call just made is lost unless something already holds it.
Random SIGINTs into repeated loads caught the old code only a few times in hundreds of loads, so these
tests place the KeyboardInterrupt at each such point in turn instead: a profile hook raises it when a
function of the os module returns (the result is then dropped, as the handler drops it) and when
op_builder.atomic_file.open_into's list.extend returns (the C call that runs os.open there). The code under
test runs unchanged. (A SIGINT in pure Python code can always cut a cleanup short; those windows are
nanoseconds, a system call's are not.)
"""

from __future__ import annotations

import gc
import os
import posix
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from child import run_in_child

import deepnvme
import op_builder.atomic_file

_OPEN_INTO = getattr(getattr(op_builder.atomic_file, "open_into", None), "__code__", None)


def _signal_point(frame: FrameType, event: str, arg: Any) -> bool:
    """Whether a KeyboardInterrupt for a SIGINT that came during a system call would be raised here: when
    a function of the os module returns, or the C call in open_into that runs os.open (list.extend)."""
    return event == "c_return" and (getattr(arg, "__self__", None) is posix or frame.f_code is _OPEN_INTO)


def _count_points(fn: Callable[[], Any]) -> int:
    count = 0

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        count += _signal_point(frame, event, arg)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _interrupt_at(k: int, fn: Callable[[], Any]) -> str:
    """Run fn() with a KeyboardInterrupt raised at its k-th signal point; where it was ("" if fn() has
    fewer)."""
    seen = 0
    fired = ""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal seen, fired
        if _signal_point(frame, event, arg):
            seen += 1
            if seen > k:
                fired = f"after {arg.__name__} in {frame.f_code.co_name}:{frame.f_lineno}"
                raise KeyboardInterrupt  # the profiler is switched off by this: one interrupt per run

    sys.setprofile(hook)
    try:
        fn()
    except KeyboardInterrupt:
        if not fired:
            raise
    finally:
        sys.setprofile(None)
    return fired


def _descriptors() -> dict[str, str]:
    """This process's open descriptors and what they are, once save's closer threads have ended (a save
    closes the file it replaced on a thread of its own)."""
    for thread in threading.enumerate():
        if thread.name == "deepnvme-free-replaced":
            thread.join()
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return out


def _state() -> dict[str, Any]:
    return {"big": torch.arange(300_000, dtype=torch.float32), "mid": torch.ones(20_000),
            "small": torch.arange(10)}


def _leaks_at_every_point(fn: Callable[[], Any], check: Callable[[], None]) -> None:
    fn()  # handles, threads and imports made once, before the descriptors are counted
    gc.collect()
    before = _descriptors()
    points = _count_points(fn)
    assert points > 10  # the hook sees the calls: else this test tests nothing
    failures = []
    for k in range(points + 1):
        fired = _interrupt_at(k, fn)
        gc.collect()
        leaked = {fd: target for fd, target in _descriptors().items() if before.get(fd) != target}
        if leaked:
            failures.append(f"interrupt {k} ({fired}): leaked {leaked}")
            for fd in leaked:
                os.close(int(fd))
        check()
        if not fired:
            break
    assert not failures, "\n".join(failures)


def test_an_interrupt_at_any_system_call_of_load_leaks_no_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    state = _state()
    deepnvme.save(state, path)

    def check() -> None:
        got = deepnvme.load(path)
        assert all(torch.equal(got[k], v) for k, v in state.items())

    _leaks_at_every_point(lambda: deepnvme.load(path), check)


def test_an_interrupt_at_any_system_call_of_save_leaks_no_descriptor_nor_temporary(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    old, new = _state(), {"other": torch.full((200_000,), 7.0)}
    deepnvme.save(old, path)

    def check() -> None:
        assert sorted(os.listdir(tmp_path)) == ["c.pt"]  # no temporary left
        got = torch.load(path)
        assert got.keys() in (old.keys(), new.keys())  # the old file or the new one, whole
        deepnvme.save(old, path)

    _leaks_at_every_point(lambda: deepnvme.save(new, path), check)


def test_an_interrupt_inside_torchs_callbacks_stays_an_interrupt(tmp_path: Path) -> None:
    """A Ctrl-C while torch's C++ is inside the stream's readinto (load) or write (save) reaches the caller as
    what the SIGINT handler raised (KeyboardInterrupt, or a program's own exception), not as torch's own
    error about the stream ("damaged or not a torch checkpoint", "unexpected pos"): a good file must not look
    damaged, and a save is not a failed write. The save leaves the old file whole and no temporary. In a
    fresh interpreter: the signal handlers and load's settings are then the defaults whatever ran before.
    A real SIGINT is sent as the (k+1)-th readinto or write call begins (Python raises there, before the
    function's first line)."""
    out = run_in_child(tmp_path, textwrap.dedent("""
        import os, signal, sys
        import torch
        import deepnvme

        d = sys.argv[1]
        path = os.path.join(d, "c.pt")
        old = {"big": torch.arange(300_000, dtype=torch.float32), "small": torch.arange(10)}
        deepnvme.save(old, path)

        def interrupted_in(name, k, fn):
            seen = 0

            def hook(frame, event, arg):
                nonlocal seen
                if event == "call" and frame.f_code.co_name == name:
                    seen += 1
                    if seen > k:
                        sys.setprofile(None)
                        signal.raise_signal(signal.SIGINT)

            sys.setprofile(hook)
            try:
                fn()
            except BaseException as exc:
                return exc
            finally:
                sys.setprofile(None)
            return None

        class Stop(Exception):
            pass

        def own_handler(signum, frame):
            raise Stop

        for handler, expected in ((signal.default_int_handler, KeyboardInterrupt), (own_handler, Stop)):
            signal.signal(signal.SIGINT, handler)
            for k in range(6):
                exc = interrupted_in("readinto", k, lambda: deepnvme.load(path))
                assert isinstance(exc, expected), f"load, readinto call {k}: {exc!r}"
                exc = interrupted_in("write", k, lambda: deepnvme.save({"other": torch.ones(300_000)}, path))
                assert isinstance(exc, expected), f"save, write call {k}: {exc!r}"
                assert sorted(n for n in os.listdir(d) if not n.endswith(".py")) == ["c.pt"]
                got = torch.load(path)
                assert all(torch.equal(got[key], v) for key, v in old.items())
                assert signal.getsignal(signal.SIGINT) is handler  # the program's handler is back
        print("ok")
    """), timeout=120)
    assert out.strip() == "ok"
