"""deepnvme.tools.resident.touch_pages: every page behind a tensor becomes resident, nothing is changed."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from deepnvme.tools.resident import PAGE, touch_pages


def _rss_of_mapping(address: int) -> int:
    """Resident bytes of the mapping that starts at `address`, from /proc/self/smaps."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        start = line.split("-", 1)[0]
        if "-" in line.split()[0] and int(start, 16) == address:
            for follow in lines[i + 1:]:
                if follow.startswith("Rss:"):
                    return int(follow.split()[1]) * 1024
    raise LookupError(f"no mapping at {address:#x}")


def test_untouched_anonymous_pages_become_resident() -> None:
    n = 64 * PAGE
    area = mmap.mmap(-1, n)  # anonymous: no page is backed until touched
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    t = torch.frombuffer(area, dtype=torch.uint8)
    assert _rss_of_mapping(address) == 0
    touch_pages(t[PAGE + 1:PAGE + 2])  # a view: its whole storage is touched, not just its bytes
    assert _rss_of_mapping(address) == n
    assert int(t.sum()) == 0  # read only
    del t
    area.close()


def test_views_empty_and_none_are_accepted_and_left_unchanged() -> None:
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    before = x.clone()
    touch_pages(x.t(), x[1:, ::2], torch.empty(0), None, torch.empty(0, 5))
    assert torch.equal(x, before)


def test_a_non_tensor_is_a_type_error_naming_its_position() -> None:
    with pytest.raises(TypeError, match="argument 1 is a list"):
        touch_pages(torch.zeros(4), [1, 2])
