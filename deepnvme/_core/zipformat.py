"""The zip layout of torch's checkpoint archives, in one place: save's CRC bookkeeping, load's record
index and the prefetcher's check of inferred offsets all read it from here.

torch.save writes a zip archive of stored (never compressed) members through miniz: each member is a local
header (30 bytes: signature, versions, flags, method, time, CRC, sizes, name length, extra length), its
name, an extra field (padding to the storage alignment), the data, and, because flag bit 3 is set, a data
descriptor (16 bytes, 24 with zip64: signature, CRC, sizes). A central directory of 46-byte entries (plus
name, extra and comment) and the end record (with a zip64 end record where needed) close the file.
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from deepnvme._core.crc import crc32
from deepnvme._core.errors import CheckpointFormatError

__all__ = ["CENTRAL", "DESCRIPTOR", "LEGACY_MAGIC", "LOCAL", "LOCAL_HEADER_BYTES", "CrcFollower", "Record",
           "data_offset", "read_records", "storage_record"]

LOCAL = b"PK\x03\x04"
CENTRAL = b"PK\x01\x02"
DESCRIPTOR = b"PK\x07\x08"
LOCAL_HEADER_BYTES = 30
CENTRAL_HEADER_BYTES = 46
# What stock torch.save's legacy (non-zip) format starts with: pickle protocol 2 and its magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
# What zipfile raises on a damaged or crafted directory (it reads through the file object we give it).
_DIRECTORY_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, OverflowError,
                     NotImplementedError, IndexError, KeyError)


def data_offset(header: bytes | memoryview, header_offset: int) -> int | None:
    """Where a member's data starts, given the bytes of its local header found at `header_offset`;
    None when those bytes are not a local header."""
    if len(header) < LOCAL_HEADER_BYTES or bytes(header[:4]) != LOCAL:
        return None
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return header_offset + LOCAL_HEADER_BYTES + name_len + extra_len


@dataclass
class Record:
    """One stored archive member: where its bytes lie and their CRC-32 (None when torch wrote none)."""

    name: str
    offset: int
    size: int
    crc: int | None
    header_offset: int = -1  # where its local header starts; set when `offset` is a prediction to check

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def is_storage(self) -> bool:
        """torch names storage payloads <archive>/data/<key>."""
        return self.name.partition("/")[2].startswith("data/")


def _members(f: BinaryIO, path: str) -> tuple[list[zipfile.ZipInfo], int | None]:
    """The central directory's entries and where the directory starts, every structural fault of the
    directory a CheckpointFormatError naming `path`."""
    try:
        archive = zipfile.ZipFile(f)
        return archive.infolist(), getattr(archive, "start_dir", None)
    except _DIRECTORY_ERRORS as exc:
        raise CheckpointFormatError(path, f"truncated or damaged zip archive ({type(exc).__name__}: {exc})") \
            from exc


def read_records(fd: int, path: str, exact: bool = True) -> dict[int, Record] | None:
    """The archive's members by data offset; None for torch's legacy pickle format. Checks the structure:
    every member stored, inside the file, named once, its bytes shared with no other member.

    A member's data starts after its local header, whose length only the local header tells: `exact`
    reads every one (a small read each, scattered over the file). Otherwise, for archives laid out as
    torch's zip writer lays them out (each member's data, then its data descriptor, then the next
    member), the data offset is inferred from the next member's header offset and the record keeps
    `header_offset` so that the guess is checked against the local header once that has been read.
    """
    size = os.fstat(fd).st_size
    start = os.pread(fd, len(LEGACY_MAGIC), 0)
    if start == LEGACY_MAGIC:
        return None
    if size == 0:
        raise CheckpointFormatError(path, "empty file, not a torch checkpoint")
    if not start.startswith(LOCAL):
        raise CheckpointFormatError(path, "not a torch checkpoint (not a zip archive nor the legacy format)")
    # closefd=False rather than a dup: a dup can fail (EMFILE), and a Ctrl-C right after it would leak it.
    with os.fdopen(fd, "rb", closefd=False) as f:
        members, directory = _members(f, path)
    if not any(m.filename.endswith(("/data.pkl", "/constants.pkl")) for m in members):
        raise CheckpointFormatError(path, "a zip archive but not a torch checkpoint (no data.pkl)")
    names = set()
    for m in members:
        if m.filename in names:
            raise CheckpointFormatError(path, f"damaged: {m.filename} is named twice in the directory")
        names.add(m.filename)
        if m.compress_type != zipfile.ZIP_STORED or m.compress_size != m.file_size:
            raise CheckpointFormatError(path, f"damaged: {m.filename} is compressed, which torch never does")
        if not 0 <= m.header_offset <= size - LOCAL_HEADER_BYTES:
            raise CheckpointFormatError(path, f"truncated or damaged: the local header of {m.filename} "
                                        f"would lie at {m.header_offset}, outside the {size}-byte file")
    members.sort(key=lambda m: m.header_offset)
    found: list[Record] = []
    for i, m in enumerate(members):
        crc = m.CRC if (m.CRC or m.file_size == 0) else None  # torch writes 0 when compute_crc32 is off
        following = members[i + 1].header_offset if i + 1 < len(members) else directory
        offset = None if exact else _inferred_offset(m, following)
        if offset is None:
            offset = data_offset(os.pread(fd, LOCAL_HEADER_BYTES, m.header_offset), m.header_offset)
            if offset is None:
                raise CheckpointFormatError(path, f"truncated or damaged: bad local header of {m.filename}")
            record = Record(m.filename, offset, m.file_size, crc)
        else:
            record = Record(m.filename, offset, m.file_size, crc, m.header_offset)
        if record.end > size:
            raise CheckpointFormatError(path, f"truncated or damaged: {m.filename} lies outside the file")
        found.append(record)
    # load reads members into memory of their own and indexes them by offset: no two may share a byte
    # (stock torch would load such members as independent copies; one shared storage would not be that).
    found.sort(key=lambda r: (r.offset, r.size))
    records: dict[int, Record] = {}
    end = 0
    for r in found:
        if r.size and (r.offset < end or r.offset in records):
            raise CheckpointFormatError(path, f"damaged: the data of {r.name} overlaps another member's")
        records.setdefault(r.offset, r)
        end = max(end, r.end)
    return records


def _inferred_offset(m: zipfile.ZipInfo, following: int | None) -> int | None:
    """Where torch's zip writer put member `m`'s data, given where the next thing (member or directory)
    starts; None where the layout does not say. miniz writes a data descriptor (flag bit 3) after
    non-empty data: 16 bytes, or 24 when the member needs zip64 (offset or size past 32 bits)."""
    if following is None or not m.flag_bits & 0x08:
        return None
    if m.file_size == 0:
        return following  # no data, no descriptor: the offset only has to be unique and in order
    zip64 = m.header_offset >= 0xFFFFFFFF or m.file_size >= 0xFFFFFFFF
    offset = following - (24 if zip64 else 16) - m.file_size
    return offset if offset >= m.header_offset + LOCAL_HEADER_BYTES + len(m.orig_filename.encode()) else None


# The most bytes of small members (the pickle, byteorder, versions) that structure_key reads to name an
# archive; an item with more is not named (its structure is parsed every time).
STRUCTURE_KEY_BYTES = 64 << 10
# The member each torch.save writes with a new random id: no reader's result depends on it.
_SERIALIZATION_ID = ".data/serialization_id"


def storage_record(f: BinaryIO, path: str, read_at: Callable[[int, int], bytes],
                   key: bool = False) -> tuple[str, int, int] | tuple[tuple[str, int, int], Any]:
    """(key, data offset, size) of the one storage record of a single-tensor archive (a DCP item),
    reading its directory through `f` and its local headers through `read_at(offset, n)`.

    With `key`, returns that and a structure key: every member's name and size, and every other member's
    CRC-32 and bytes, except the storage payload and torch.save's random serialization id. Two items with
    equal keys hold the same pickle, records and versions, so torch.load's parse of one (everything but the
    payload's bytes and its offset) is the other's. None where the small members exceed
    STRUCTURE_KEY_BYTES or a local header is damaged (then the item is parsed on its own).
    """
    members, _ = _members(f, path)
    storages = [m for m in members if m.filename.partition("/")[2].startswith("data/")]
    if len(storages) != 1:
        raise CheckpointFormatError(path, f"an item holds {len(storages)} storage records, not one")
    m = storages[0]
    if m.compress_type != zipfile.ZIP_STORED or m.compress_size != m.file_size:
        raise CheckpointFormatError(path, f"damaged: {m.filename} is compressed, which torch never does")
    offset = data_offset(read_at(m.header_offset, LOCAL_HEADER_BYTES), m.header_offset)
    if offset is None:
        raise CheckpointFormatError(path, f"truncated or damaged: bad local header of {m.filename}")
    record = (m.filename.partition("/")[2][len("data/"):], offset, m.file_size)
    if not key:
        return record
    return record, _structure_key(members, m, read_at)


def _structure_key(members: list[zipfile.ZipInfo], storage: zipfile.ZipInfo,
                   read_at: Callable[[int, int], bytes]) -> Any:
    """See storage_record's `key`."""
    small = [x for x in members if x is not storage and not x.filename.endswith("/" + _SERIALIZATION_ID)]
    if sum(x.file_size for x in small) > STRUCTURE_KEY_BYTES:
        return None
    parts: list[Any] = [(x.filename, x.file_size) for x in members]
    for x in small:
        at = data_offset(read_at(x.header_offset, LOCAL_HEADER_BYTES), x.header_offset)
        if at is None or x.compress_type != zipfile.ZIP_STORED:
            return None
        parts.append((x.filename, x.CRC, read_at(at, x.file_size)))
    return tuple(parts)


def is_descriptor(view: memoryview, data_len: int) -> bool:
    """A data descriptor for `data_len` bytes of data, as torch leaves it (CRC zero)."""
    if len(view) == 16 and bytes(view[:4]) == DESCRIPTOR:
        crc, comp, uncomp = struct.unpack_from("<III", view, 4)
    elif len(view) == 24 and bytes(view[:4]) == DESCRIPTOR:
        crc, comp, uncomp = struct.unpack_from("<IQQ", view, 4)
    else:
        return False
    return crc == 0 and comp == uncomp == data_len


def central_entries(c: bytearray) -> Iterable[tuple[int, str, int]]:
    """(entry offset, name, data size) of each central directory entry at the start of `c`."""
    i = 0
    while c[i:i + 4] == CENTRAL and i + CENTRAL_HEADER_BYTES <= len(c):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", c, i + 28)
        at = i + CENTRAL_HEADER_BYTES
        name = bytes(c[at:at + name_len]).decode("utf-8", "replace")
        yield i, name, struct.unpack_from("<I", c, i + 24)[0]
        i += CENTRAL_HEADER_BYTES + name_len + extra_len + comment_len


class CrcFollower:
    """Follows torch's zip writer through its write() calls to put the CRC-32s into the archive.

    miniz writes each member as: local header (30 bytes, CRC and sizes zero, flag bit 3), file name,
    extra field (torch's padding to the storage alignment), then, if the member has data, the data in
    one write and a data descriptor (16 bytes, 24 for zip64: signature, CRC, sizes). An empty member has
    neither. The central directory comes last. So the write after a header's extra field is taken as
    data (its CRC computed at once) and confirmed by the descriptor that follows with its length; a write
    that may instead be the next header or the directory (it starts with their signature and is not a
    known storage) is held, copied, until that is settled. feed() and close() give back what to write,
    as (bytes, file offset, is the caller's storage payload). If the calls ever stop matching this
    layout, the follower warns and stops filling them in: the central directory keeps the zeros torch
    wrote, which torch.load and deepnvme.load read as "no CRC" (zip tools will call them wrong).
    """

    def __init__(self) -> None:
        self._header = bytearray()  # the local header being read
        self._need = LOCAL_HEADER_BYTES  # bytes of header still to come (30, then the name and extra field)
        self._state = "header"  # header | data | descriptor | central | lost
        self._name = ""
        self._data_len = 0
        self._data_crc = 0
        self._held: tuple[bytes, int] | None = None  # a write that may be data or the next header
        self._unsettled: memoryview | None = None  # data given back whose CRC is still to compute
        self._central = bytearray()
        self._central_at = 0
        self.crcs: dict[str, int] = {}

    def lost(self, why: str) -> None:
        if self._state != "lost":
            import warnings

            warnings.warn(f"deepnvme.save: {why}, which the CRC-32 bookkeeping does not follow; this "
                          "archive's CRC fields stay zero", RuntimeWarning, stacklevel=4)
            self._state = "lost"

    def feed(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        if self._state == "lost":
            return [(view, at, known_storage)]
        if self._state == "central":
            self._central += view
            return []
        if self._state == "data":
            return self._data(view, at, known_storage)
        if self._state == "descriptor":
            return self._descriptor(view, at, known_storage)
        return self._header_bytes(view, at, known_storage)

    def close(self) -> list[tuple[Any, int, bool]]:
        out: list[tuple[Any, int, bool]] = []
        if self._held is not None:  # a last write that was held and never confirmed as data
            held, self._held = self._held, None
            self._state = "header"
            out += self._header_bytes(memoryview(held[0]), held[1], False)
        if self._state == "central":
            self._patch_central()
            out.append((memoryview(self._central), self._central_at, False))
            self._central = bytearray()
        elif self._state not in ("lost", "header"):
            self.lost("torch's archive ended inside a member")
        return out

    def _header_bytes(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        if not self._header and bytes(view[:4]) == CENTRAL:
            self._state, self._central, self._central_at = "central", bytearray(view), at
            return []
        if not self._header and bytes(view[:4]) != LOCAL:
            self.lost("a member did not start with a local header")
            return [(view, at, known_storage)]
        if len(view) > self._need:
            self.lost("a local header shared a write with other bytes")
            return [(view, at, known_storage)]
        self._header += view
        self._need -= len(view)
        if self._need == 0:
            if len(self._header) == LOCAL_HEADER_BYTES:
                name_len, extra_len = struct.unpack_from("<HH", self._header, 26)
                self._need = name_len + extra_len
            if self._need == 0:
                name_len = struct.unpack_from("<H", self._header, 26)[0]
                self._name = bytes(self._header[30:30 + name_len]).decode("utf-8", "replace")
                self._header, self._need, self._state = bytearray(), LOCAL_HEADER_BYTES, "data"
        return [(view, at, known_storage)]

    def _data(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        self._data_len = len(view)
        self._state = "descriptor"
        if not known_storage and bytes(view[:4]) in (LOCAL, CENTRAL):
            # The member may be empty and this the next header or the directory: hold it until known.
            self._held = (bytes(view), at)
            self._data_crc = crc32(self._held[0])
            return []
        # Written first (settle() computes its CRC after), so the CRC overlaps the payload's own write.
        self._unsettled = view
        return [(view, at, known_storage)]

    def expects_data(self) -> bool:
        """Whether the next bytes written are a member's data (a header and its extra field just ended)."""
        return self._state == "data"

    def data_written(self, nbytes: int, crc: int) -> None:
        """The member's data was written by the caller (in pieces, its CRC-32 `crc` computed as they went):
        the descriptor that follows is next."""
        self._data_len, self._data_crc, self._state = nbytes, crc, "descriptor"

    def settle(self) -> None:
        """The CRC of the data feed() just gave back, once the caller has queued its write."""
        if self._unsettled is not None:
            self._data_crc = crc32(self._unsettled)
            self._unsettled = None

    def _descriptor(self, view: memoryview, at: int, known_storage: bool) -> list[tuple[Any, int, bool]]:
        held, self._held = self._held, None
        if is_descriptor(view, self._data_len):
            self.crcs[self._name] = self._data_crc
            patched = bytearray(view)
            struct.pack_into("<I", patched, 4, self._data_crc)
            self._state = "header"
            out = [] if held is None else [(memoryview(held[0]), held[1], False)]
            return [*out, (memoryview(patched), at, False)]
        if held is None:
            self.lost("a member's data was not followed by its data descriptor")
            return [(view, at, known_storage)]
        # The held write was no data: the member was empty and that write came after it.
        self.crcs[self._name] = 0
        self._state = "header"
        out = self._header_bytes(memoryview(held[0]), held[1], False)
        return out + self.feed(view, at, known_storage)

    def _patch_central(self) -> None:
        """Put each member's CRC into its central directory entry."""
        for at, name, size in central_entries(self._central):
            if name in self.crcs:
                struct.pack_into("<I", self._central, at + 16, self.crcs[name])
            elif size:
                self.lost(f"the central directory names {name!r}, which was not followed")
                return
