"""The self-describing on-disk record (format v2): a 160-byte inline header, then the stored payload (FORMAT.md)."""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
import threading

import numpy as np
import xxhash
import zstandard

from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.core.versions import VersionKey
from kvtier.store.errors import CorruptRecord, FormatVersionError, QuarantineReason

FORMAT_VERSION = 2
MAGIC = b"KVTEXT\x00\x02"

# Form codes are part of the format (FORMAT.md), independent of enum order.
FORM_CODES: dict[CacheForm, int] = {
    CacheForm.COMPRESSED: 1,
    CacheForm.TAIL: 2,
    CacheForm.SWA: 3,
    CacheForm.INDEXER: 4,
}
FORMS_BY_CODE = {v: k for k, v in FORM_CODES.items()}
RECORD_FORMS = tuple(FORM_CODES)  # the forms a record can carry, in their on-disk code order


class Codec(enum.IntEnum):
    """How the payload is stored; recorded in the header and the index."""

    NONE = 0
    ZSTD = 1

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown codec {name!r}: use 'none' or 'zstd'") from None


# magic, version, form (0: namespace record), codec, group len, flags, header bytes, namespace, block hash,
# layout digest, group, payload len, stored len, created, payload checksum (xxh3_128), device checksum, reserved
_FIXED = struct.Struct("<8sHBBBBH16s16s16s32sQQd16sQ8x")
_CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = _FIXED.size + _CHECKSUM.size  # 160: the inline header in front of every v2 payload
# The same fields as a numpy record (loads that check a batch's headers at once, kvtier.store.packed), and the
# header's checksum after them.
HEADER_DTYPE = np.dtype(
    [
        ("magic", "V8"),
        ("version", "<u2"),
        ("form", "u1"),
        ("codec", "u1"),
        ("group_len", "u1"),
        ("flags", "u1"),
        ("header_bytes", "<u2"),
        ("namespace", "V16"),
        ("block_hash", "V16"),
        ("layout_digest", "V16"),
        ("group", "S32"),
        ("payload_len", "<u8"),
        ("stored_len", "<u8"),
        ("created", "<f8"),
        ("payload_checksum", "V16"),
        ("device_checksum", "<u8"),
        ("_reserved", "V8"),
        ("checksum", "<u8"),
    ]
)
LARGE_PAYLOAD = DISK_ALIGNMENT  # payloads at least this long start 4096-aligned (O_DIRECT / GDS straight reads)
RECORD_ALIGNMENT = 32  # every v2 header starts 32-aligned (HEADER_BYTES is a multiple: rebuild resyncs in these steps)
NAMESPACE_RECORD = 0  # form code of the record that carries a namespace's VersionKey JSON
MAX_VERSION_KEY_BYTES = 3942  # the v1 header block's room for it, kept so a namespace fits either format
assert HEADER_DTYPE.itemsize == HEADER_BYTES


class Flags(enum.IntFlag):
    """Which payload checksums a v2 record carries (at least one)."""

    XXH3 = 1  # payload_checksum holds xxh3_128 of the stored bytes
    DEVSUM = 2  # device_checksum holds `devsum.device_checksum` of the stored bytes


def record_length(stored_len: int) -> int:
    """Bytes a v2 record occupies: its inline header and the stored payload (alignment gaps are not counted)."""
    return HEADER_BYTES + stored_len


def header_offset(cursor: int, stored_len: int) -> int:
    """Where the next record's header goes at or after `cursor` in an extent that starts 4096-aligned.

    Small payloads pack at 32-byte steps (a small object costs its header and padding beside it); a large one is
    placed so that its payload starts on a 4096 boundary with its header in the bytes just before it."""
    if stored_len >= LARGE_PAYLOAD:
        return align_up(cursor + HEADER_BYTES, DISK_ALIGNMENT) - HEADER_BYTES
    return align_up(cursor, RECORD_ALIGNMENT)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordHeader:
    """The 160-byte inline header of a v2 record (or of a namespace record: form None, payload = VersionKey JSON)."""

    namespace: bytes
    block_hash: bytes
    group: str
    form: CacheForm | None
    layout_digest: bytes
    codec: Codec
    payload_len: int
    stored_len: int
    created: float
    flags: Flags
    payload_checksum: bytes = bytes(16)
    device_checksum: int = 0

    record_version = FORMAT_VERSION
    header_bytes = HEADER_BYTES

    @property
    def record_len(self) -> int:
        return record_length(self.stored_len)

    def pack_into(self, buf: memoryview, at: int) -> None:
        """Write the header (checksummed) into buf[at : at + HEADER_BYTES]."""
        buf[at : at + HEADER_BYTES] = header_bytes(
            self.namespace,
            self.block_hash,
            self.group,
            NAMESPACE_RECORD if self.form is None else FORM_CODES[self.form],
            self.layout_digest,
            self.codec,
            self.flags,
            self.payload_len,
            self.stored_len,
            self.created,
            self.payload_checksum,
            self.device_checksum,
        )

    @classmethod
    def unpack(cls, buf: memoryview | bytes, at: int = 0) -> RecordHeader:
        """Parse and check the header at `at`; CorruptRecord if it is not one, FormatVersionError if newer."""
        end = at + _FIXED.size
        if len(buf) < end + _CHECKSUM.size:
            raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside a record header")
        if bytes(buf[at : at + 8]) != MAGIC:
            raise CorruptRecord(QuarantineReason.HEADER, "bad magic")
        if xxhash.xxh3_64_intdigest(buf[at:end]) != _CHECKSUM.unpack_from(buf, end)[0]:
            raise CorruptRecord(QuarantineReason.HEADER, "header checksum mismatch")
        (_, version, form, codec, glen, flags, hbytes, ns, bh, ld, group, plen, slen, created, psum, dsum) = (
            _FIXED.unpack_from(buf, at)
        )
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"record format v{version} is newer than v{FORMAT_VERSION} this kvtier reads: upgrade kvtier"
            )
        try:
            header = cls(
                ns,
                bh,
                group[:glen].decode(),
                None if form == NAMESPACE_RECORD else FORMS_BY_CODE[form],
                ld,
                Codec(codec),
                plen,
                slen,
                created,
                Flags(flags),
                psum,
                dsum,
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise CorruptRecord(QuarantineReason.HEADER, f"unparseable field: {exc}") from None
        if version != FORMAT_VERSION or hbytes != HEADER_BYTES or not flags & (Flags.XXH3 | Flags.DEVSUM):
            raise CorruptRecord(QuarantineReason.HEADER, "inconsistent header")
        return header


_GROUP_FIELDS: dict[str, tuple[int, bytes]] = {}  # group name -> (its utf-8 length, its bytes), few names


def header_bytes(
    namespace: bytes,
    block_hash: bytes,
    group: str,
    form_code: int,
    layout_digest: bytes,
    codec: int,
    flags: int,
    payload_len: int,
    stored_len: int,
    created: float,
    payload_checksum: bytes,
    device_checksum: int,
) -> bytes:
    """The exact HEADER_BYTES of a v2 record with these fields, its checksum included. What the writer writes,
    and what the load path compares a record's header bytes with (built from its key and index entry, which
    holds the same creation time): one pack, one hash and one bytes comparison check every field."""
    g = _GROUP_FIELDS.get(group)
    if g is None:
        raw = group.encode()
        g = (len(raw), raw)
        if len(_GROUP_FIELDS) < 1024:  # bounded: group names come from requests
            _GROUP_FIELDS[group] = g
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        form_code,
        codec,
        g[0],
        flags,
        HEADER_BYTES,
        namespace,
        block_hash,
        layout_digest,
        g[1],
        payload_len,
        stored_len,
        created,
        payload_checksum,
        device_checksum,
    )
    return fixed + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fixed))


def namespace_record(version_key: VersionKey, created: float) -> tuple[RecordHeader, bytes]:
    """The record that makes an extent self-describing: its namespace's canonical VersionKey JSON."""
    body = version_key.canonical()
    header = RecordHeader(
        version_key.namespace,
        bytes(16),
        "",
        None,
        bytes(16),
        Codec.NONE,
        len(body),
        len(body),
        created,
        Flags.XXH3,
        payload_checksum(body),
    )
    return header, body


def namespace_of(body: bytes) -> bytes | None:
    """The namespace a namespace record's VersionKey JSON digests to; None if it does not parse."""
    try:
        return VersionKey.from_dict(json.loads(body)).namespace
    except (ValueError, KeyError, TypeError):
        return None


payload_checksum = xxhash.xxh3_128_digest  # of the stored (post-codec) payload bytes: the C function itself, no frame


def leading_h64(rows: np.ndarray, nbytes: int) -> np.ndarray:
    """xxh3_64 of each row's first `nbytes` (`rows`: a 2-D uint8 array, one header or index value a row): the
    bytes copied out as one bytes object a row and hashed by a C-level map, not a Python step per row (these run
    per object of every load)."""
    heads = np.ascontiguousarray(rows[:, :nbytes]).view(f"V{nbytes}").ravel().tolist()
    return np.fromiter(map(xxhash.xxh3_64_intdigest, heads), np.uint64, len(heads))


_local = threading.local()


def zstd_compress(data: memoryview | bytes) -> bytes:
    """Compress with a per-thread compressor (zstandard objects are not thread-safe)."""
    comp = getattr(_local, "comp", None)
    if comp is None:
        comp = _local.comp = zstandard.ZstdCompressor(level=3)
    return comp.compress(data)


def zstd_decompress_into(data: memoryview | bytes, dst: memoryview) -> None:
    """Decompress exactly len(dst) bytes into dst; anything else is a corrupt record."""
    dec = getattr(_local, "dec", None)
    if dec is None:
        dec = _local.dec = zstandard.ZstdDecompressor()
    got = 0
    try:
        with dec.stream_reader(data) as reader:
            while got < len(dst):
                n = reader.readinto(dst[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CorruptRecord(QuarantineReason.DECODE, str(exc)) from None
    if got != len(dst) or extra:
        raise CorruptRecord(QuarantineReason.DECODE, f"payload does not decode to the {len(dst)} bytes the header says")
