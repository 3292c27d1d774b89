"""O_DIRECT really in effect: after a transfer through aio_handle on the real disk, none of the file's pages
is in the page cache (mincore over a mapping of the file). A transfer that silently went through a buffered
descriptor moves the right bytes, so only the page cache tells it apart. Every engine, locked and staged
(plain, misaligned) tensors, inline (one block) and worker (many blocks) requests, writes and reads."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from deepnvme.tools.pagecache import cached_pages, drop_file_cache, read_mode

BLOCK = 1 << 20
U8 = torch.empty(0, dtype=torch.uint8)


@pytest.fixture
def direct_dir(workdir: Path) -> Path:
    """The work directory, where O_DIRECT must work (it does on the disk the suite runs on)."""
    if read_mode(str(workdir)) != "O_DIRECT":
        pytest.skip(f"O_DIRECT does not work in {workdir}")
    return workdir


@pytest.mark.parametrize("nbytes", [BLOCK // 2, 8 * BLOCK], ids=["inline", "workers"])
@pytest.mark.parametrize("memory", ["locked", "staged"])
def test_direct_transfers_leave_no_cached_pages(aio_module: ModuleType, engine: str, direct_dir: Path,
                                                memory: str, nbytes: int) -> None:
    h = aio_module.aio_handle(BLOCK, 8, False, True, 2, engine=engine)
    if memory == "locked":
        t = h.new_cpu_locked_tensor(nbytes, U8)
    else:
        t = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]  # misaligned for any O_DIRECT: staged
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    want = t.clone()
    path = direct_dir / f"f-{engine}-{memory}"
    assert h.sync_pwrite(t, str(path)) == 1
    assert cached_pages(path) == 0, f"{engine} {memory}: the write left pages in the page cache"
    assert path.read_bytes() == want.numpy().tobytes()
    assert cached_pages(path) > 0  # a buffered read caches pages, and cached_pages() sees them
    assert drop_file_cache(str(path)) and cached_pages(path) == 0
    t.zero_()
    assert h.sync_pread(t, str(path)) == 1
    assert cached_pages(path) == 0, f"{engine} {memory}: the read left pages in the page cache"
    assert torch.equal(t, want)
    if memory == "locked":
        h.free_cpu_locked_tensor(t)
