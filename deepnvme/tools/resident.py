"""Make a tensor's pages resident before a timed transfer, so that the clock measures I/O, not the host.

On a virtual machine the host may take back guest memory that has sat untouched while something else
allocated much (fio's buffers, another benchmark). The next touch of such a page waits for the host
(bench/results/fio_methodology.md has a figure), and the guest books that wait as CPU time of whatever
touched the page: a staging copy inside the handle, or the disk's DMA. fio never pays it inside its clock,
because it allocates and zeroes its buffers before the clock starts; a benchmark that reuses one tensor
across cases must touch it first to compare like with like.
"""

from __future__ import annotations

from typing import Any

from deepnvme._core.memory import PAGE

__all__ = ["PAGE", "touch_pages"]


def touch_pages(*tensors: Any) -> None:
    """Read one byte of every page behind each CPU tensor (its whole storage). Device tensors, empty ones and
    None are skipped; anything else that is not a tensor is a TypeError. One read per page: cheap next to
    the I/O it prepares."""
    import torch

    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"touch_pages: argument {i} is a {type(t).__name__}, not a torch.Tensor")
        if t is None or t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
            continue
        whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        whole[::PAGE].sum()
