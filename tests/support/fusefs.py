"""A small in-memory FUSE file system, served by a child process through /dev/fuse (no libfuse, no
fusermount: root mounts it with mount(2)), that refuses opens with O_DIRECT with an errno of the test's
choice. Linux itself answers EINVAL for a file system without direct I/O (ramfs); file systems that check
the flag in their own open (some FUSE and network ones) answer what they like, EOPNOTSUPP among them. This
is such a file system, real to the kernel: every open, read, write, rename and fsync of the code under test
goes through the kernel's FUSE client to the handlers below.

Enough of the protocol for files in one flat directory (what a checkpoint, a handle's file or a swap space's
folder needs): lookup, getattr/setattr, create/open/read/write/fsync/flush/release, mkdir/rmdir (a swap
space's per-process folder), unlink, rename, readdir, statfs. Anything else answers ENOSYS, which the
kernel remembers and works around.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Opcodes (linux/fuse.h).
LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
MKDIR, UNLINK, RMDIR, RENAME = 9, 10, 11, 12
OPEN, READ, WRITE, STATFS, RELEASE, FSYNC, FLUSH, INIT = 14, 15, 16, 17, 18, 20, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, ACCESS, CREATE, DESTROY, BATCH_FORGET = 27, 28, 29, 30, 34, 35, 38, 42
NO_REPLY = {FORGET, BATCH_FORGET}

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error (negative errno), unique
ATTR = struct.Struct("<QQQQQQIIIIIIIII4x")  # ino size blocks atime mtime ctime, nsecs, mode nlink uid gid
# rdev blksize, flags
FUSE_BIG_WRITES = 1 << 5
MAX_WRITE = 128 << 10
ROOT = 1


@dataclass
class Node:
    """A file or directory: its bytes, or its entries by name."""

    ino: int
    mode: int
    data: bytearray = field(default_factory=bytearray)
    entries: dict[str, int] = field(default_factory=dict)


class RefusingFS:
    """The file system: nodes by inode number, and the errno an open with O_DIRECT gets."""

    def __init__(self, refuse_errno: int) -> None:
        self.refuse = refuse_errno
        self.nodes = {ROOT: Node(ROOT, stat.S_IFDIR | 0o755)}
        self.next_ino = ROOT + 1
        self.direct_opens_refused = 0

    # -------------------------------------------------------------------------------------- replies
    def attr(self, node: Node) -> bytes:
        now = int(time.time())
        size = len(node.data)
        nlink = 2 if stat.S_ISDIR(node.mode) else 1
        return ATTR.pack(node.ino, size, (size + 511) // 512, now, now, now, 0, 0, 0, node.mode, nlink, 0, 0,
                         0, 4096)

    def entry(self, node: Node) -> bytes:
        return struct.pack("<QQQQII", node.ino, 0, 0, 0, 0, 0) + self.attr(node)

    def attr_out(self, node: Node) -> bytes:
        return struct.pack("<QII", 0, 0, 0) + self.attr(node)

    # ------------------------------------------------------------------------------------- handlers
    def make(self, parent: int, name: str, mode: int) -> Node:
        node = Node(self.next_ino, mode)
        self.next_ino += 1
        self.nodes[node.ino] = node
        self.nodes[parent].entries[name] = node.ino
        return node

    def handle(self, op: int, nodeid: int, body: bytes) -> bytes | int:
        """The reply's body for a request, or a positive errno."""
        node = self.nodes.get(nodeid)
        if op == INIT:
            major, minor, readahead = struct.unpack_from("<III", body)
            return struct.pack("<IIIIHHIIHHI", 7, min(minor, 31), readahead, FUSE_BIG_WRITES, 16, 12,
                               MAX_WRITE, 1, 32, 0, 0) + bytes(28)
        if node is None:
            return errno.ENOENT
        name = body.split(b"\0", 1)[0].decode(errors="surrogateescape")
        if op == LOOKUP:
            child = node.entries.get(name)
            return errno.ENOENT if child is None else self.entry(self.nodes[child])
        if op == GETATTR:
            return self.attr_out(node)
        if op == SETATTR:
            valid, = struct.unpack_from("<I", body)
            if valid & (1 << 3):  # FATTR_SIZE
                size, = struct.unpack_from("<Q", body, 16)
                node.data[size:] = b""
                node.data.extend(bytes(size - len(node.data)))
            if valid & 1:  # FATTR_MODE
                mode, = struct.unpack_from("<I", body, 68)
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
            return self.attr_out(node)
        if op in (OPEN, OPENDIR):
            flags, = struct.unpack_from("<I", body)
            if op == OPEN and flags & os.O_DIRECT:
                self.direct_opens_refused += 1
                return self.refuse
            return struct.pack("<QIi", 0, 0, 0)
        if op == CREATE:
            flags, mode = struct.unpack_from("<II", body)
            name = body[16:].split(b"\0", 1)[0].decode(errors="surrogateescape")
            if flags & os.O_DIRECT:
                self.direct_opens_refused += 1
                return self.refuse
            existing = node.entries.get(name)
            mode = stat.S_IFREG | (mode & 0o7777)
            child = self.nodes[existing] if existing else self.make(nodeid, name, mode)
            return self.entry(child) + struct.pack("<QIi", 0, 0, 0)
        if op == MKDIR:
            mode, = struct.unpack_from("<I", body)
            name = body[8:].split(b"\0", 1)[0].decode(errors="surrogateescape")
            if name in node.entries:
                return errno.EEXIST
            return self.entry(self.make(nodeid, name, stat.S_IFDIR | (mode & 0o7777)))
        if op in (UNLINK, RMDIR):
            child = node.entries.get(name)
            if child is None:
                return errno.ENOENT
            if op == RMDIR and self.nodes[child].entries:
                return errno.ENOTEMPTY
            del node.entries[name]
            return b""
        if op == RENAME:
            newdir, = struct.unpack_from("<Q", body)
            old, new = body[8:].split(b"\0")[:2]
            child = node.entries.pop(old.decode(errors="surrogateescape"), None)
            if child is None:
                return errno.ENOENT
            self.nodes[newdir].entries[new.decode(errors="surrogateescape")] = child
            return b""
        if op == READ:
            _, offset, size = struct.unpack_from("<QQI", body)
            if stat.S_ISDIR(node.mode):
                return self.readdir(node, offset, size)
            return bytes(node.data[offset:offset + size])
        if op == WRITE:
            _, offset, size = struct.unpack_from("<QQI", body)
            data = body[40:40 + size]
            if len(node.data) < offset:
                node.data.extend(bytes(offset - len(node.data)))
            node.data[offset:offset + size] = data
            return struct.pack("<II", size, 0)
        if op == READDIR:
            _, offset, size = struct.unpack_from("<QQI", body)
            return self.readdir(node, offset, size)
        if op == STATFS:
            blocks = struct.pack("<QQQQQ", 1 << 20, 1 << 19, 1 << 19, 1000, 900)
            return blocks + struct.pack("<IIII", 4096, 255, 4096, 0) + bytes(24)
        if op in (RELEASE, RELEASEDIR, FLUSH, FSYNC, FSYNCDIR, ACCESS):
            return b""
        return errno.ENOSYS

    def readdir(self, node: Node, offset: int, size: int) -> bytes:
        names = [(".", node.ino), ("..", ROOT), *node.entries.items()]
        out = b""
        for i, (name, ino) in enumerate(names[offset:], start=offset + 1):
            raw = name.encode(errors="surrogateescape")
            kind = (self.nodes[ino].mode >> 12) & 0o17
            rec = struct.pack("<QQII", ino, i, len(raw), kind) + raw
            rec += bytes(-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return out

    # -------------------------------------------------------------------------------------- serving
    def serve(self, dev: int) -> None:
        """Answer requests from the /dev/fuse descriptor `dev` until it is unmounted or closed."""
        while True:
            try:
                request = os.read(dev, MAX_WRITE + 4096)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):  # ENOENT: an interrupted request
                    continue
                return  # ENODEV: unmounted; EBADF: closed
            length, op, unique, nodeid, *_ = IN_HEADER.unpack_from(request)
            if op in NO_REPLY:
                continue
            if op == DESTROY:
                return
            try:
                result = self.handle(op, nodeid, request[IN_HEADER.size:length])
            except Exception:  # a malformed request must not hang the test: answer EIO
                result = errno.EIO
            body, error = (b"", -result) if isinstance(result, int) else (result, 0)
            with contextlib.suppress(OSError):  # ENOENT: the request was interrupted meanwhile
                os.write(dev, OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique) + body)


@dataclass
class Mounted:
    """A mounted RefusingFS: where, and (once unmounted) how many O_DIRECT opens it refused."""

    path: Path
    refused: int = -1


@contextlib.contextmanager
def refusing_o_direct(where: Path, refuse_errno: int) -> Iterator[Mounted]:
    """Mount a :class:`RefusingFS` at `where` (created) for the block, served by a child process (a server
    thread in the test process would deadlock on the GIL with a page fault of a mapped file there); skips
    the test where that is not allowed (not root, no /dev/fuse, a kernel without FUSE)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a FUSE file system needs root")
    where.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([sys.executable, __file__, str(where), str(refuse_errno)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = server.stdout.readline().strip() if server.stdout else ""
    if ready != "mounted":
        server.wait(timeout=30)
        pytest.skip(f"cannot mount a FUSE file system here: {ready or server.stderr.read().strip()}")
    mounted = Mounted(where)
    try:
        yield mounted
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
        try:
            out, _ = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            out, _ = server.communicate()
        refused = [line for line in out.split() if line.startswith("refused=")]
        mounted.refused = int(refused[-1].split("=")[1]) if refused else -1


def _serve_mounted(where: str, refuse_errno: int) -> int:
    """The server process: open /dev/fuse, mount it at `where`, say "mounted", serve until unmounted, then
    print how many O_DIRECT opens were refused."""
    try:
        dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        print(f"no /dev/fuse: {exc.strerror}", flush=True)
        return 1
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={dev},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"deepnvme-test", where.encode(), b"fuse", 0, options) != 0:
        print(f"mount(2) failed: {os.strerror(ctypes.get_errno())}", flush=True)
        return 1
    print("mounted", flush=True)
    fs = RefusingFS(refuse_errno)
    fs.serve(dev)
    print(f"refused={fs.direct_opens_refused}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_serve_mounted(sys.argv[1], int(sys.argv[2])))
