"""What type checkers see of the compiled async_io op: its module and its ``aio_handle``.

The op is a pybind11 extension built at run time, so no stub ships with it; these Protocols describe the
interface the library and tools use (csrc/aio/bind_handle.h and py_aio.cpp are the definition). A file
target is a path (``str``, ``bytes`` or ``os.PathLike``) or an open descriptor (``int``, never closed by
the handle). Importing this module imports neither torch nor the op.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol, Union

if TYPE_CHECKING:
    import torch

__all__ = ["AioHandle", "AioModule", "FileTarget", "PathLike"]

# A path, or a descriptor that stays open (the handle never closes it).
PathLike = Union[str, bytes, "os.PathLike[str]"]
FileTarget = Union[str, bytes, "os.PathLike[str]", int]


class AioHandle(Protocol):
    """DeepSpeed's aio_handle: requests split over worker threads, completed by wait(), or one at a time by
    wait_request() for those made by submit_pread/submit_pwrite."""

    def get_block_size(self) -> int: ...
    def get_queue_depth(self) -> int: ...
    def get_single_submit(self) -> bool: ...
    def get_overlap_events(self) -> bool: ...
    def get_intra_op_parallelism(self) -> int: ...
    def get_alignment(self) -> int: ...
    def get_engine(self) -> str: ...

    def read(self, buffer: torch.Tensor, filename: PathLike, validate: bool,
             file_offset: int = 0) -> int: ...
    def write(self, buffer: torch.Tensor, filename: PathLike, validate: bool,
              file_offset: int = 0) -> int: ...
    def pread(self, buffer: torch.Tensor, filename: FileTarget, validate: bool,
              async_: bool, /, file_offset: int = 0) -> int: ...
    def pwrite(self, buffer: torch.Tensor, filename: FileTarget, validate: bool,
               async_: bool, /, file_offset: int = 0) -> int: ...
    def sync_pread(self, buffer: torch.Tensor, filename: FileTarget,
                   file_offset: int = 0) -> int: ...
    def sync_pwrite(self, buffer: torch.Tensor, filename: FileTarget,
                    file_offset: int = 0) -> int: ...
    def async_pread(self, buffer: torch.Tensor, filename: FileTarget,
                    file_offset: int = 0) -> int: ...
    def async_pwrite(self, buffer: torch.Tensor, filename: FileTarget,
                     file_offset: int = 0) -> int: ...
    def wait(self) -> int: ...
    # Completion per request (README, "Completion per request"): the id is for wait_request/request_done only;
    # wait() and the sync calls never cover such a request.
    def submit_pread(self, buffer: torch.Tensor, filename: FileTarget, file_offset: int = 0) -> int:
        """Queue a read into `buffer`; return its request id at once."""
    def submit_pwrite(self, buffer: torch.Tensor, filename: FileTarget, file_offset: int = 0) -> int:
        """Queue a write of `buffer`; return its request id at once."""
    def wait_request(self, request_id: int) -> int:
        """Wait for that request alone; return its byte count or raise its own OSError. Once per id:
        ValueError for an id not pending on this handle. KeyboardInterrupt leaves the request pending."""
    def request_done(self, request_id: int) -> bool:
        """Whether that request has finished, without handing it over; ValueError for an unknown id."""
    def wait_completed(self, timeout: float | None = None) -> list[int]:
        """Ids of submit_* requests finished since an earlier call named them (each named once), after at
        least one finished or `timeout` seconds passed (then []); hands nothing over."""
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor: ...
    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool: ...
    def is_pinned(self, buffer: torch.Tensor) -> bool: ...


class AioModule(Protocol):
    """The async_io op's module: the handle type and the module-level functions."""

    def aio_handle(self, block_size: int = ..., queue_depth: int = ..., single_submit: bool = ...,
                   overlap_events: bool = ..., intra_op_parallelism: int = ...,
                   engine: str = ...) -> AioHandle: ...
    def aio_read(self, buffer: torch.Tensor, filename: PathLike, block_size: int,
                 queue_depth: int, single_submit: bool, overlap_events: bool, validate: bool) -> int: ...
    def aio_write(self, buffer: torch.Tensor, filename: PathLike, block_size: int,
                  queue_depth: int, single_submit: bool, overlap_events: bool, validate: bool) -> int: ...
    def empty_at_residue(self, nbytes: int, residue: int) -> torch.Tensor: ...
    def available_engines(self) -> list[str]: ...
    def engine_status(self) -> dict[str, str]: ...
