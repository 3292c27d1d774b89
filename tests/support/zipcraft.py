"""Byte-level edits of torch's zip archives, to build the damaged and hostile files the checkpoint tests
feed to deepnvme.load, AioStorageReader and stock torch side by side. Each edit returns new bytes and keeps
every other byte where it was, so that the file is hostile in one way only."""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from io import BytesIO

END = b"PK\x05\x06"
END64 = b"PK\x06\x06"


@dataclass
class Entry:
    """One central directory entry of an archive: where it lies and what it says."""

    at: int  # offset of the central entry in the file
    name: str
    header_offset: int
    size: int


def entries(data: bytes, base: int = 0) -> list[Entry]:
    """The central directory entries of the archive in `data` (which starts at file offset `base`)."""
    archive = zipfile.ZipFile(BytesIO(data))
    at = archive.start_dir
    out = []
    while data[at:at + 4] == b"PK\x01\x02":
        size = struct.unpack_from("<I", data, at + 24)[0]
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        header = struct.unpack_from("<I", data, at + 42)[0]
        name = data[at + 46:at + 46 + name_len].decode()
        out.append(Entry(base + at, name, header, size))
        at += 46 + name_len + extra_len + comment_len
    return out


def entry(data: bytes, suffix: str) -> Entry:
    """The entry whose name ends with `suffix` (e.g. "data/0", "data.pkl")."""
    found = [e for e in entries(data) if e.name.endswith(suffix)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} entries end with {suffix!r}")
    return found[0]


def alias(data: bytes, name: str, onto: str) -> bytes:
    """Point entry `name` at the local header (hence the data) of entry `onto`."""
    out = bytearray(data)
    struct.pack_into("<I", out, entry(data, name).at + 42, entry(data, onto).header_offset)
    return bytes(out)


def set_directory_offset(data: bytes, offset: int) -> bytes:
    """Make the end record(s) claim the central directory starts at `offset`."""
    out = bytearray(data)
    end = data.rindex(END)
    struct.pack_into("<I", out, end + 16, offset & 0xFFFFFFFF)
    end64 = data.rfind(END64)
    if end64 >= 0:
        struct.pack_into("<Q", out, end64 + 48, offset)
    return bytes(out)


def rename(data: bytes, name: str, new: str) -> bytes:
    """Rename an entry in its local header and the central directory (the new name has the same length)."""
    e = entry(data, name)
    old = e.name.encode()
    new_b = new.encode()
    if len(new_b) != len(old):
        raise ValueError("the new name must have the old one's length")
    out = bytearray(data)
    out[e.header_offset + 30:e.header_offset + 30 + len(old)] = new_b
    out[e.at + 46:e.at + 46 + len(old)] = new_b
    return bytes(out)


def set_size(data: bytes, name: str, size: int) -> bytes:
    """Make the central directory (and the data descriptor) say entry `name` holds `size` bytes."""
    e = entry(data, name)
    out = bytearray(data)
    struct.pack_into("<II", out, e.at + 20, size, size)
    return bytes(out)


def data_offset(data: bytes, name: str) -> int:
    """Where entry `name`'s data starts."""
    e = entry(data, name)
    name_len, extra_len = struct.unpack_from("<HH", data, e.header_offset + 26)
    return e.header_offset + 30 + name_len + extra_len
