"""What the command-line tools share: size arguments, usage errors, the handle that writes input files,
the engine choices and the stream readable output goes to."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from deepnvme._core.aio_types import AioHandle, AioModule
from deepnvme._core.handles import RECOMMENDED
from deepnvme.filesystem import fsync_path
from deepnvme.tools.sizes import parse_size
from op_builder.engines import AUTO
from op_builder.engines import names as engine_names

__all__ = ["EXIT_USAGE", "GB", "UsageError", "engine_choices", "fsync_path", "human_out",
           "size_arg", "writer"]

GB = 1024**3  # DeepSpeed's unit for "GB/sec"
EXIT_USAGE = 2  # argparse's status for a bad command line


class UsageError(Exception):
    """A bad command line: every problem found, each naming its argument."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


def size_arg(text: str) -> int:
    """argparse type for K/M/G sizes (argparse names the argument in its error)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_choices() -> tuple[str, ...]:
    """What ``--io_engine``/``--engine`` accept: auto, then every real engine of the catalogue."""
    return (AUTO, *engine_names())


def writer(aio: AioModule) -> AioHandle:
    """An aio_handle with the recommended settings, for making input files (reads need a full file first):
    fast everywhere, not tuned."""
    return aio.aio_handle(**RECOMMENDED)


def human_out(json_mode: bool) -> TextIO:
    """Where readable lines go: stderr when stdout carries one JSON record, else stdout."""
    return sys.stderr if json_mode else sys.stdout
