"""The errors a checkpoint reader or writer raises, in one vocabulary: a file that is not a readable
checkpoint is a CheckpointFormatError naming it; a failed system call is an OSError carrying its errno and
the path the caller gave (never a temporary name or a descriptor number)."""

from __future__ import annotations

import errno
import os
import pickle
from typing import Any

__all__ = ["CheckpointFormatError", "RefusedPickle", "with_path"]


class CheckpointFormatError(ValueError):
    """The file is not a readable checkpoint: truncated, damaged, crafted, or of another format.

    A ValueError (what such faults were before the type existed), with the file in `filename` as an
    OSError has it.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.filename = path
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (torch.distributed.checkpoint gathers a rank's error to every rank): the default
        # would call the class with the message alone.
        return (type(self), (self.filename, self.problem), self.__dict__)


class RefusedPickle(CheckpointFormatError, pickle.UnpicklingError):
    """torch.load(weights_only=True) refused the file's pickle: stock torch's UnpicklingError, and a
    CheckpointFormatError naming the file like every other refusal to read it."""


def with_path(exc: OSError, path: str, action: str = "writing") -> OSError:
    """`exc` again (same errno, hence the same OSError subclass) naming `path` and what was being done.

    The handle names descriptors and a save names its temporary file; the caller knows neither.
    """
    code = exc.errno if exc.errno is not None else errno.EIO
    return OSError(code, f"{os.strerror(code)} ({action})", path)
