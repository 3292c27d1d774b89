"""A position-dependent fill for test buffers: cheap to make, and it exposes misplaced or shifted blocks."""

from __future__ import annotations

from typing import Any


def fill_pattern(t: Any) -> None:
    """Fill a contiguous uint8 tensor so that every 8-byte word holds a distinct value."""
    import torch

    words = t[: t.numel() // 8 * 8].view(torch.int64)
    torch.arange(words.numel(), dtype=torch.int64, out=words).mul_(-7046029254386353131)
    t[words.numel() * 8:] = 0x5A
