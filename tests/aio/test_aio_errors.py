"""Bad input and real failures: every one raises the right Python exception and the handle survives."""

from __future__ import annotations

import errno
import mmap
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from mounts import mount_or_skip, sh, umount
from thread_helpers import wait_until

MiB = 1 << 20


def tbytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor of any dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(n: int) -> tuple[torch.Tensor, bytes]:
    """A plain uint8 tensor holding n random bytes, and the bytes."""
    data = os.urandom(n)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), data


@pytest.fixture(scope="module")
def fs_4kn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An ext4 file system on a loop device with 4096-byte logical sectors (a 4Kn drive)."""
    base = tmp_path_factory.mktemp("4kn")
    img, mnt = base / "fs.img", base / "mnt"
    with open(img, "wb") as f:
        f.truncate(64 * MiB)
    if os.geteuid() != 0:
        pytest.skip("needs root for losetup")
    r = sh("losetup", "-f", "--show", "-b", "4096", str(img))
    if r.returncode != 0:
        pytest.skip(f"losetup -b 4096 failed: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        if sh("mkfs.ext4", "-q", dev).returncode != 0:
            pytest.skip("mkfs.ext4 on the 4Kn loop device failed")
        mount_or_skip([dev], mnt)
        try:
            yield mnt
        finally:
            umount(mnt)
    finally:
        sh("losetup", "-d", dev)


@pytest.fixture
def handle(aio_module: ModuleType, engine: str):
    """A small handle with P=2 on the engine under test."""
    return aio_module.aio_handle(4096, 8, False, True, 2, engine=engine)


def assert_usable(h, workdir: Path) -> None:
    """The handle still does correct I/O and has nothing pending."""
    assert h.wait() == 0
    src, data = random_tensor(10000)
    assert h.sync_pwrite(src, str(workdir / "after")) == 1
    dst = torch.zeros(10000, dtype=torch.uint8)
    assert h.sync_pread(dst, str(workdir / "after")) == 1
    assert tbytes(dst) == data


# ----------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("kwargs", [
    {"block_size": 0}, {"block_size": -4096}, {"queue_depth": 0}, {"queue_depth": -1},
    {"intra_op_parallelism": 0}, {"intra_op_parallelism": -2},
])
def test_bad_handle_sizes(aio_module: ModuleType, kwargs: dict) -> None:
    """Non-positive block size, queue depth or parallelism is a ValueError, not a crash."""
    with pytest.raises(ValueError):
        aio_module.aio_handle(**kwargs)


@pytest.mark.parametrize("args", [
    ("big",), (4096, "deep"), (4096, 8, False, False, 1.5), (4096, 8, False, False, 1, 3),
])
def test_bad_handle_types(aio_module: ModuleType, args: tuple) -> None:
    """Wrong argument types for the constructor are TypeErrors."""
    with pytest.raises(TypeError):
        aio_module.aio_handle(*args)


def _all_calls(h, m, buf, path: str, offset: int = 0):
    """Every entry point with the same buffer, file and offset."""
    return {
        "sync_pread": lambda: h.sync_pread(buf, path, offset),
        "sync_pwrite": lambda: h.sync_pwrite(buf, path, offset),
        "async_pread": lambda: h.async_pread(buf, path, offset),
        "async_pwrite": lambda: h.async_pwrite(buf, path, offset),
        "pread": lambda: h.pread(buf, path, False, False, offset),
        "pwrite": lambda: h.pwrite(buf, path, False, True, offset),
        "read": lambda: h.read(buf, path, False, offset),
        "write": lambda: h.write(buf, path, False, offset),
    }


CALLS = ["sync_pread", "sync_pwrite", "async_pread", "async_pwrite", "pread", "pwrite", "read", "write"]


@pytest.mark.parametrize("call", CALLS)
def test_non_contiguous_rejected(aio_module, handle, workdir: Path, call: str) -> None:
    """A non-contiguous tensor is a ValueError before any I/O (DeepSpeed lost such reads)."""
    path = workdir / "f"
    path.write_bytes(bytes(64 * 64 * 4))
    buf = torch.zeros(64, 64).t()
    with pytest.raises(ValueError):
        _all_calls(handle, aio_module, buf, str(path))[call]()
    assert path.read_bytes() == bytes(64 * 64 * 4)
    assert handle.wait() == 0


@pytest.mark.parametrize("call", CALLS)
def test_negative_offset_rejected(aio_module, handle, workdir: Path, call: str) -> None:
    """A negative file offset is a ValueError."""
    path = workdir / "f"
    path.write_bytes(bytes(8192))
    with pytest.raises(ValueError):
        _all_calls(handle, aio_module, torch.zeros(4096, dtype=torch.uint8), str(path), -4096)[call]()
    assert handle.wait() == 0


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("bad", [b"\0" * 16, bytearray(16), [0] * 16, None],
                         ids=["bytes", "bytearray", "list", "None"])
def test_non_tensor_buffer(aio_module, handle, workdir: Path, call: str, bad) -> None:
    """Something that is not a tensor is a TypeError."""
    path = workdir / "f"
    path.write_bytes(bytes(16))
    with pytest.raises(TypeError):
        _all_calls(handle, aio_module, bad, str(path))[call]()


def test_wrong_argument_types(handle, workdir: Path) -> None:
    """A float file name, a string offset or a string flag are TypeErrors."""
    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(TypeError):
        handle.sync_pread(buf, 1.5)
    with pytest.raises(TypeError):
        handle.sync_pwrite(buf, str(workdir / "f"), "0")
    with pytest.raises(TypeError):
        handle.pread(buf, str(workdir / "f"), "yes", False)


def test_module_functions_bad_input(aio_module: ModuleType, workdir: Path) -> None:
    """aio_read/aio_write validate their arguments like the handle does."""
    path = workdir / "f"
    path.write_bytes(bytes(4096))
    buf = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError):
        aio_module.aio_read(buf, str(path), 0, 8, False, False, False)
    with pytest.raises(ValueError):
        aio_module.aio_write(buf, str(path), 4096, 0, False, False, False)
    with pytest.raises(ValueError):
        aio_module.aio_write(torch.zeros(64, 64).t(), str(path), 4096, 8, False, False, False)
    with pytest.raises(TypeError):
        aio_module.aio_read(b"abc", str(path), 4096, 8, False, False, False)
    with pytest.raises(FileNotFoundError):
        aio_module.aio_read(buf, str(workdir / "missing"), 4096, 8, False, False, False)
    with pytest.raises(ValueError):
        aio_module.aio_read(torch.zeros(8192, dtype=torch.uint8), str(path), 4096, 8, False, False, False)


# ----------------------------------------------------------------------------- missing, short, unwritable

READS = ["sync_pread", "pread", "read"]


@pytest.mark.parametrize("call", READS)
def test_missing_file(aio_module, handle, workdir: Path, call: str) -> None:
    """Reading a missing file raises FileNotFoundError with errno and file name; the handle survives."""
    path = str(workdir / "missing.bin")
    with pytest.raises(FileNotFoundError) as exc:
        _all_calls(handle, aio_module, torch.zeros(4096, dtype=torch.uint8), path)[call]()
    assert exc.value.errno == errno.ENOENT
    assert exc.value.filename == path
    assert_usable(handle, workdir)


def test_missing_file_async(handle, workdir: Path) -> None:
    """An async read of a missing file raises at the call or at the wait() that collects it, not both."""
    path = str(workdir / "missing.bin")
    try:
        rc = handle.async_pread(torch.zeros(4096, dtype=torch.uint8), path)
    except FileNotFoundError as e:
        assert e.errno == errno.ENOENT and e.filename == path
    else:
        assert rc == 0
        with pytest.raises(FileNotFoundError) as exc:
            handle.wait()
        assert exc.value.filename == path
    assert_usable(handle, workdir)


@pytest.mark.parametrize("call", ["sync_pread", "async_pread", "pread", "read"])
@pytest.mark.parametrize("offset,size", [(0, 8192), (4000, 200), (4096, 1), (0, 4097)])
def test_read_past_eof(aio_module, handle, workdir: Path, call: str, offset: int, size: int) -> None:
    """A read past EOF raises ValueError naming file and sizes at the call, before touching the buffer."""
    path = workdir / "short.bin"
    path.write_bytes(os.urandom(4096))
    buf = torch.full((size,), 0xEE, dtype=torch.uint8)
    with pytest.raises(ValueError) as exc:
        _all_calls(handle, aio_module, buf, str(path), offset)[call]()
    msg = str(exc.value)
    assert "short.bin" in msg and "4096" in msg, msg
    assert bool((buf == 0xEE).all())
    assert handle.wait() == 0
    assert_usable(handle, workdir)


def test_read_past_eof_by_fd(handle, workdir: Path) -> None:
    """A read past EOF through a descriptor is a ValueError too, and the descriptor stays open."""
    path = workdir / "short.bin"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError):
            handle.sync_pread(torch.zeros(4097, dtype=torch.uint8), fd=fd)
        with pytest.raises(ValueError):
            handle.async_pread(torch.zeros(10, dtype=torch.uint8), fd=fd, file_offset=4090)
        assert handle.wait() == 0
        os.fstat(fd)
    finally:
        os.close(fd)


def test_bad_fd(handle, workdir: Path) -> None:
    """A closed descriptor is an OSError EBADF, and a read-only one refuses writes with EBADF."""
    path = workdir / "ro"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError) as exc:
        handle.sync_pread(torch.zeros(16, dtype=torch.uint8), fd=fd)
    assert exc.value.errno == errno.EBADF
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as exc:
            handle.sync_pwrite(torch.zeros(4096, dtype=torch.uint8), fd=fd)
        assert exc.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert_usable(handle, workdir)


def test_append_only_descriptor_refuses_writes_and_reads(handle, workdir: Path) -> None:
    """A write through a descriptor opened with O_APPEND raises OSError EINVAL naming it, before any byte is
    written: Linux ignores pwrite's offset there, so every block would land at the end of the file in the
    order the blocks finish, reported as success. Reads through it are positional and work."""
    path = workdir / "appended"
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    try:
        for call in (handle.sync_pwrite, handle.async_pwrite):
            with pytest.raises(OSError, match="O_APPEND") as exc:
                call(torch.zeros(1 << 20, dtype=torch.uint8), fd, 0)
            assert exc.value.errno == errno.EINVAL and exc.value.filename == f"<fd {fd}>"
        assert handle.wait() == 0
        got = torch.empty(1 << 20, dtype=torch.uint8)
        assert handle.sync_pread(got, fd, 0) == 1 and torch.equal(got, data)
    finally:
        os.close(fd)
    assert path.read_bytes() == data.numpy().tobytes()
    assert_usable(handle, workdir)


@pytest.mark.parametrize("call", ["sync_pwrite", "pwrite", "write", "async_pwrite"])
def test_immutable_file(aio_module, handle, workdir: Path, call: str) -> None:
    """Writing an immutable file (chattr +i, which binds root too) raises PermissionError with the name."""
    path = workdir / "frozen"
    path.write_bytes(b"keep")
    if sh("chattr", "+i", str(path)).returncode != 0:
        pytest.skip("chattr +i not supported here")
    try:
        buf = torch.zeros(4096, dtype=torch.uint8)
        with pytest.raises(PermissionError) as exc:
            _all_calls(handle, aio_module, buf, str(path))[call]()
            handle.wait()
        assert exc.value.filename == str(path)
        assert handle.wait() == 0
    finally:
        sh("chattr", "-i", str(path))
    assert path.read_bytes() == b"keep"
    assert_usable(handle, workdir)


@pytest.mark.parametrize("call", ["sync_pwrite", "sync_pread", "write", "read"])
def test_path_under_regular_file(aio_module, handle, workdir: Path, call: str) -> None:
    """A path through a regular file raises NotADirectoryError carrying the path."""
    (workdir / "plain").write_bytes(bytes(10))
    path = str(workdir / "plain" / "child")
    with pytest.raises(NotADirectoryError) as exc:
        _all_calls(handle, aio_module, torch.zeros(16, dtype=torch.uint8), path)[call]()
    assert exc.value.errno == errno.ENOTDIR and exc.value.filename == path
    assert_usable(handle, workdir)


@pytest.mark.parametrize("call", ["sync_pwrite", "write"])
def test_directory_as_file(aio_module, handle, workdir: Path, call: str) -> None:
    """Writing to a directory raises IsADirectoryError carrying the path."""
    path = str(workdir)
    with pytest.raises(IsADirectoryError) as exc:
        _all_calls(handle, aio_module, torch.zeros(16, dtype=torch.uint8), path)[call]()
    assert exc.value.errno == errno.EISDIR and exc.value.filename == path
    assert_usable(handle, workdir)


def test_read_only_mount(handle, tmp_path: Path, workdir: Path) -> None:
    """Writing under a read-only bind mount raises OSError EROFS with the file name; reads still work."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 4096)
    mount_or_skip(["--bind", str(src)], ro)
    try:
        if sh("mount", "-o", "remount,bind,ro", str(ro)).returncode != 0:
            pytest.skip("cannot remount read-only")
        for name in ("f", "new"):
            with pytest.raises(OSError) as exc:
                handle.sync_pwrite(torch.zeros(4096, dtype=torch.uint8), str(ro / name))
            assert exc.value.errno == errno.EROFS and exc.value.filename == str(ro / name)
        dst = torch.zeros(4096, dtype=torch.uint8)
        assert handle.sync_pread(dst, str(ro / "f")) == 1
        assert tbytes(dst) == b"x" * 4096
    finally:
        umount(ro)
    assert_usable(handle, workdir)


# ----------------------------------------------------------------------------- full file system

@pytest.mark.parametrize("mode", ["sync", "async", "write"])
def test_full_file_system(handle, full_fs: Path, workdir: Path, mode: str) -> None:
    """Filling a 16 MiB file system raises OSError ENOSPC with the name, from the call or its wait()."""
    path = full_fs / f"big-{mode}"
    src = torch.ones(24 * MiB, dtype=torch.uint8)
    try:
        with pytest.raises(OSError) as exc:
            if mode == "sync":
                handle.sync_pwrite(src, str(path))
            elif mode == "write":
                handle.write(src, str(path), False)
            else:
                small = torch.ones(4096, dtype=torch.uint8)
                assert handle.async_pwrite(src, str(path)) == 0
                assert handle.async_pwrite(small, str(workdir / "ok")) == 0
                handle.wait()
        assert exc.value.errno == errno.ENOSPC
        assert exc.value.filename == str(path)
        if mode == "async":
            assert (workdir / "ok").read_bytes() == b"\1" * 4096, "other requests must finish first"
        assert handle.wait() == 0
    finally:
        path.unlink(missing_ok=True)
    small, data = random_tensor(8192)
    assert handle.sync_pwrite(small, str(full_fs / "small")) == 1
    assert (full_fs / "small").read_bytes() == data
    (full_fs / "small").unlink()
    assert_usable(handle, workdir)


# ----------------------------------------------------------------------------- 4Kn device

def test_4kn_device_alignment(aio_module: ModuleType, engine: str, fs_4kn: Path) -> None:
    """On 4096-byte sectors, 512-aligned requests still work: alignment comes from the device, not 512."""
    probe = fs_4kn / "probe"
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        mem = mmap.mmap(-1, 4096)
        with pytest.raises(OSError):
            os.pwrite(fd, memoryview(mem)[:512], 512)  # the precondition: 512-byte O_DIRECT is refused here
    finally:
        os.close(fd)
    h = aio_module.aio_handle(4096, 8, False, True, 2, engine=engine)
    assert h.get_alignment() == 2 * 512  # DeepSpeed's value, whatever the device wants
    path = str(fs_4kn / f"f-{engine}")
    model = bytearray()
    for off, size in ((512, 3584), (0, 1536), (1024, 8192), (4608, 65536), (0, 3 * 4096), (3, 10000)):
        src = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        data = os.urandom(size)
        src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        assert h.sync_pwrite(src, path, off) == 1
        model.extend(bytes(max(0, off + size - len(model))))
        model[off:off + size] = data
        dst = torch.empty(size + 512, dtype=torch.uint8)[512:]
        assert h.sync_pread(dst, path, off) == 1
        assert tbytes(dst) == data
    assert Path(path).read_bytes() == bytes(model)


# ----------------------------------------------------------------------------- ramfs (no O_DIRECT)

def test_ramfs_falls_back_with_one_warning(aio_module: ModuleType, engine: str, ramfs: Path) -> None:
    """On a file system refusing O_DIRECT, I/O is buffered, correct, and warns exactly once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for par in (1, 2, 3):
            h = aio_module.aio_handle(4096, 8, False, True, par, engine=engine)
            for size, off in ((4096, 0), (MiB, 8192), (4097, 1), (1, 5)):
                path = str(ramfs / f"f{par}-{size}")
                src = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
                data = os.urandom(size)
                src.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                assert h.sync_pwrite(src, path, off) == 1
                assert Path(path).read_bytes() == bytes(off) + data
                dst = torch.zeros(size, dtype=torch.uint8)
                assert h.async_pread(dst, path, off) == 0
                assert h.wait() == 1
                assert tbytes(dst) == data
                assert h.write(src, path, False, off) == 0
                assert h.read(dst, path, True, off) == 0
            assert aio_module.aio_write(src, str(ramfs / "m"), 4096, 4, False, False, False) == 0
    odirect = [w for w in caught if "O_DIRECT" in str(w.message)]
    assert len(odirect) == 1, [str(w.message) for w in caught]
    assert issubclass(odirect[0].category, RuntimeWarning)


# ----------------------------------------------------------------------------- validate and stdout

def test_validate_respects_offset(aio_module: ModuleType, handle, workdir: Path) -> None:
    """validate=True compares at file_offset (DeepSpeed compared from 0) and passes silently."""
    path = workdir / "v"
    path.write_bytes(os.urandom(3 * 4096))
    src, data = random_tensor(4096)
    assert handle.pwrite(src, str(path), True, False, 4096) == 1
    assert handle.pwrite(src, str(path), True, True, 8192 + 3) == 0
    assert handle.wait() == 1
    dst = torch.zeros(4096, dtype=torch.uint8)
    assert handle.pread(dst, str(path), True, False, 4096) == 1
    assert tbytes(dst) == data
    assert handle.pread(dst, str(path), True, True, 0) == 0
    assert handle.wait() == 1
    assert handle.write(src, str(path), True, 5) == 0
    assert handle.read(dst, str(path), True, 5) == 0


def test_never_prints(aio_module: ModuleType, handle, workdir: Path, capfd: pytest.CaptureFixture) -> None:
    """Neither successful nor failing calls write anything to stdout (DeepSpeed printed timings)."""
    path = str(workdir / "p")
    src, _ = random_tensor(MiB + 3)
    handle.sync_pwrite(src, path)
    handle.write(src, path, True)
    handle.read(src, path, True)
    handle.pread(src, path, True, False)
    aio_module.aio_write(src, path, 4096, 4, False, False, True)
    aio_module.aio_read(src, path, 4096, 4, False, False, True)
    handle.wait()
    for bad in (lambda: handle.sync_pread(src, path + ".missing"),
                lambda: handle.sync_pread(torch.zeros(2 * MiB, dtype=torch.uint8), path),
                lambda: handle.read(src, path + ".missing", False)):
        with pytest.raises((OSError, ValueError)):
            bad()
    out, _ = capfd.readouterr()
    assert out == ""


@pytest.mark.parametrize("kind", ["read", "write"])
def test_validate_mismatch_raises(handle, workdir: Path, capfd: pytest.CaptureFixture, kind: str) -> None:
    """validate=True raises RuntimeError on a mismatch (DeepSpeed printed 'Fail' and returned success)."""
    path = workdir / "v"
    data = os.urandom(8192)
    path.write_bytes(data)
    buf = handle.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8))
    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    # Change the file (read) or the buffer (write) once the transfer has landed, before wait() validates it:
    # waiting for the bytes to arrive, not for a time that a busy machine may overrun.
    if kind == "read":
        buf.zero_()
        assert handle.pread(buf, str(path), True, True, 0) == 0
        wait_until(lambda: tbytes(buf) == data, "the read's bytes in the buffer")
        path.write_bytes(os.urandom(8192))
    else:
        path.write_bytes(b"")
        assert handle.pwrite(buf, str(path), True, True, 0) == 0
        wait_until(lambda: path.read_bytes() == data, "the write's bytes in the file")
        buf[100] ^= 0xFF
    with pytest.raises(RuntimeError):
        handle.wait()
    assert capfd.readouterr().out == ""
    assert_usable(handle, workdir)


@pytest.mark.parametrize("par", [1, 3])
def test_file_shrinking_under_read(aio_module: ModuleType, engine: str, workdir: Path, par: int) -> None:
    """A file truncated during a read raises EIO 'short transfer' (or, if the read won, has intact data)."""
    path = workdir / "shrink"
    data = os.urandom(16 * MiB)
    path.write_bytes(data)
    h = aio_module.aio_handle(65536, 1, False, False, par, engine=engine)
    buf = h.new_cpu_locked_tensor(len(data), torch.empty(0, dtype=torch.uint8))
    assert h.async_pread(buf, str(path)) == 0
    os.truncate(path, 12345)
    try:
        assert h.wait() == 1
    except OSError as e:
        assert e.errno == errno.EIO and "short transfer" in str(e) and e.filename == str(path)
    else:
        assert tbytes(buf) == data
    assert_usable(h, workdir)


@pytest.fixture
def block_device(tmp_path: Path) -> Iterator[str]:
    """A 16 MiB loop block device (st_size is 0 for block devices; their size comes from the device)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for losetup")
    img = tmp_path / "blk.img"
    with open(img, "wb") as f:
        f.truncate(16 * MiB)
    r = sh("losetup", "-f", "--show", str(img))
    if r.returncode != 0:
        pytest.skip(f"losetup failed: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        yield dev
    finally:
        sh("losetup", "-d", dev)


def test_block_device_roundtrip(aio_module: ModuleType, engine: str, block_device: str) -> None:
    """A raw block device can be written and read back; reading past the device's end is a ValueError."""
    h = aio_module.aio_handle(MiB, 8, False, True, 2, engine=engine)
    src, data = random_tensor(3 * MiB + 5)
    assert h.sync_pwrite(src, block_device, 4096 + 7) == 1
    dst = torch.zeros(len(data), dtype=torch.uint8)
    assert h.sync_pread(dst, block_device, 4096 + 7) == 1
    assert tbytes(dst) == data
    with pytest.raises(ValueError):
        h.sync_pread(torch.zeros(4096, dtype=torch.uint8), block_device, 16 * MiB - 100)


def test_block_device_write_past_end(aio_module: ModuleType, engine: str, block_device: str) -> None:
    """Writing across or beyond a block device's end raises OSError ENOSPC naming the device."""
    h = aio_module.aio_handle(MiB, 8, False, True, 2, engine=engine)
    src, _ = random_tensor(8192)
    for off in (16 * MiB - 100, 16 * MiB - 4096, 16 * MiB, 20 * MiB):
        with pytest.raises(OSError) as exc:
            h.sync_pwrite(src, block_device, off)
        assert exc.value.errno == errno.ENOSPC and exc.value.filename == block_device
    assert h.wait() == 0
