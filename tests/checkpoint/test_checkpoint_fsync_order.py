"""An atomic save is durable only if its fsyncs come in the right order around the rename: the new file's
data is synced before the rename puts it under the checkpoint's name, and the directory is synced after
the rename, so that the new name itself survives a power loss. Neither order can be seen in the files a
save leaves, so the test interposes on the calls: a small LD_PRELOAD library, compiled here, logs every
fsync/fdatasync (with the descriptor's path from /proc/self/fd) and rename in a child process that saves
through the public entry points (deepnvme.save and DCP's save with AioStorageWriter), and that writes the
project's two small replaced files: the JIT cache's stamp and the MoE checkpoint's `latest`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* One line per call, appended with one write(): lines from several threads never mix. */
static void log_line(const char* call, const char* a, const char* b) {
    const char* where = getenv("FSYNC_ORDER_LOG");
    if (where == NULL) return;
    char line[8400];
    int n = snprintf(line, sizeof line, "%s\t%s\t%s\n", call, a, b ? b : "");
    if (n <= 0 || n >= (int)sizeof line) return;
    int fd = open(where, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ssize_t w = write(fd, line, (size_t)n);
    (void)w;
    close(fd);
}

static void log_fd(const char* call, int fd) {
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    path[n > 0 ? n : 0] = '\0';
    log_line(call, path, NULL);
}

static void at_path(int dirfd, const char* name, char* out, size_t size) {
    if (name[0] == '/' || dirfd == AT_FDCWD) {
        if (name[0] == '/' || getcwd(out, size) == NULL) snprintf(out, size, "%s", name);
        else snprintf(out + strlen(out), size - strlen(out), "/%s", name);
        return;
    }
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
    ssize_t n = readlink(link, out, size - 1);
    out[n > 0 ? n : 0] = '\0';
    snprintf(out + strlen(out), size - strlen(out), "/%s", name);
}

int fsync(int fd) {
    int (*real)(int) = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    log_fd("fsync", fd);
    return real(fd);
}

int fdatasync(int fd) {
    int (*real)(int) = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    log_fd("fdatasync", fd);
    return real(fd);
}

int rename(const char* a, const char* b) {
    int (*real)(const char*, const char*) = (int (*)(const char*, const char*))dlsym(RTLD_NEXT, "rename");
    int res = real(a, b);
    char pa[4096], pb[4096];
    at_path(AT_FDCWD, a, pa, sizeof pa);
    at_path(AT_FDCWD, b, pb, sizeof pb);
    if (res == 0) log_line("rename", pa, pb);
    return res;
}

int renameat(int da, const char* a, int db, const char* b) {
    int (*real)(int, const char*, int, const char*) =
        (int (*)(int, const char*, int, const char*))dlsym(RTLD_NEXT, "renameat");
    int res = real(da, a, db, b);
    char pa[4096], pb[4096];
    at_path(da, a, pa, sizeof pa);
    at_path(db, b, pb, sizeof pb);
    if (res == 0) log_line("rename", pa, pb);
    return res;
}

int renameat2(int da, const char* a, int db, const char* b, unsigned flags) {
    int (*real)(int, const char*, int, const char*, unsigned) =
        (int (*)(int, const char*, int, const char*, unsigned))dlsym(RTLD_NEXT, "renameat2");
    int res = real(da, a, db, b, flags);
    char pa[4096], pb[4096];
    at_path(da, a, pa, sizeof pa);
    at_path(db, b, pb, sizeof pb);
    if (res == 0) log_line("rename", pa, pb);
    return res;
}
"""

CHILD = r"""
import sys
import torch
import deepnvme

where, target = sys.argv[1], sys.argv[2]
if where == "save":
    for n in range(2):  # a new file, then one replacing it
        deepnvme.save({"w": torch.arange(300000, dtype=torch.float32), "n": n}, target)
elif where == "stamp":  # the JIT cache's stamp, the file a warm load trusts
    from pathlib import Path
    from op_builder import jit_cache

    for n in range(2):
        jit_cache._write_stamp(Path(target), {"n": n})
elif where == "latest":  # the MoE checkpoint's pointer to its newest tag
    from deepnvme._core.files import write_atomically

    for tag in ("global_step1", "global_step2"):
        write_atomically(target, tag.encode())
else:
    import torch.distributed.checkpoint as dcp
    from deepnvme.checkpoint import AioStorageWriter

    dcp.save({"w": torch.arange(300000, dtype=torch.float32), "b": torch.ones(7)},
             storage_writer=AioStorageWriter(target))
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interposing library, built with the C compiler the ops are built with."""
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM)
    lib = d / "libfsync_order.so"
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(d / "shim.c"), "-ldl"], check=True,
                   capture_output=True, text=True, timeout=120)
    return lib


def logged_calls(shim: Path, tmp_path: Path, where: str, target: Path) -> list[tuple[str, str, str]]:
    """Run one save in a child with the shim preloaded; the calls it logged, in order."""
    log = tmp_path / "calls.log"
    preload = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(shim)) if p)
    env = dict(os.environ, LD_PRELOAD=preload, FSYNC_ORDER_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", CHILD, where, str(target)], env=env, check=True, timeout=180)
    return [tuple(line.split("\t")) for line in log.read_text().splitlines()]  # type: ignore[misc]


def check_order(calls: list[tuple[str, str, str]], inside: Path) -> list[str]:
    """Every rename onto a name in `inside` needs an fsync of its source before it and an fsync of the
    directory after it; returns the renames it checked."""
    syncs = [(i, path) for i, (call, path, _) in enumerate(calls) if call in ("fsync", "fdatasync")]
    checked = []
    for i, (call, src, dst) in enumerate(calls):
        if call != "rename" or os.path.dirname(dst) != str(inside):
            continue
        assert any(j < i and path == src for j, path in syncs), \
            f"{src} was renamed to {dst} before it was fsynced:\n" + "\n".join(map(str, calls))
        assert any(j > i and path == str(inside) for j, path in syncs), \
            f"the directory {inside} was not fsynced after renaming {dst}:\n" + "\n".join(map(str, calls))
        checked.append(os.path.basename(dst))
    return checked


def test_save_syncs_the_file_before_and_the_directory_after_the_rename(shim: Path, tmp_path: Path) -> None:
    """deepnvme.save of a new file, then over it."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    calls = logged_calls(shim, tmp_path, "save", folder / "model.pt")
    assert check_order(calls, folder) == ["model.pt", "model.pt"], calls


def test_dcp_writer_syncs_files_and_directory_around_renames(shim: Path, tmp_path: Path) -> None:
    """AioStorageWriter: each data file and `.metadata`."""
    folder = tmp_path / "dcp"
    calls = logged_calls(shim, tmp_path, "dcp", folder)
    checked = check_order(calls, folder)
    assert ".metadata" in checked and any(name.endswith(".distcp") for name in checked), calls


def test_jit_stamp_and_moe_latest_take_the_same_recipe(shim: Path, tmp_path: Path) -> None:
    """The JIT stamp (op_builder) and MoE's `latest` (through the library's error rule) are replaced by the
    one recipe in op_builder.atomic_file: fsync, rename, directory fsync, each time."""
    stamp_dir = tmp_path / "build"
    stamp_dir.mkdir()
    from op_builder.jit_cache import STAMP_FILE

    assert check_order(logged_calls(shim, tmp_path, "stamp", stamp_dir), stamp_dir) == [STAMP_FILE] * 2
    moe = tmp_path / "moe"
    moe.mkdir()
    (tmp_path / "calls.log").unlink()
    assert check_order(logged_calls(shim, tmp_path, "latest", moe / "latest"), moe) == ["latest"] * 2
