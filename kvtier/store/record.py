"""The self-describing on-disk record: a 4096-byte header block, then the stored payload, padded to 4096 B."""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
import threading

import xxhash
import zstandard

from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.core.versions import VersionKey
from kvtier.store.errors import CorruptRecord, FormatVersionError, QuarantineReason

FORMAT_VERSION = 1
MAGIC = b"KVTREC\x00\x01"
HEADER_BYTES = DISK_ALIGNMENT
MAX_GROUP_BYTES = 32

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


# magic, version, header bytes, form, codec, group len, flags, namespace, block hash, layout digest, group,
# payload len, stored len, record len, created, payload checksum (xxh3_128), version-key json len
_FIXED = struct.Struct("<8sHHBBBB16s16s16s32sQQQd16sH")
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = HEADER_BYTES - _CHECKSUM.size
MAX_VERSION_KEY_BYTES = _CHECKSUM_AT - _FIXED.size


def record_length(stored_len: int) -> int:
    """Bytes a record occupies in its segment: header block plus payload padded to 4096."""
    return HEADER_BYTES + align_up(stored_len, DISK_ALIGNMENT)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordHeader:
    """Everything needed to index a record from its segment alone."""

    namespace: bytes
    block_hash: bytes
    group: str
    form: CacheForm
    layout_digest: bytes
    codec: Codec
    payload_len: int
    stored_len: int
    created: float
    payload_checksum: bytes
    version_key: bytes  # canonical VersionKey JSON of the namespace

    @property
    def record_len(self) -> int:
        return record_length(self.stored_len)

    def pack_into(self, buf: memoryview) -> None:
        """Write the 4096-byte header block (zero padded, checksummed) into buf[:HEADER_BYTES]."""
        group = self.group.encode()
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            FORM_CODES[self.form],
            int(self.codec),
            len(group),
            0,
            self.namespace,
            self.block_hash,
            self.layout_digest,
            group,
            self.payload_len,
            self.stored_len,
            self.record_len,
            self.created,
            self.payload_checksum,
            len(self.version_key),
        )
        end = _FIXED.size + len(self.version_key)
        buf[: _FIXED.size] = fixed
        buf[_FIXED.size : end] = self.version_key
        buf[end:_CHECKSUM_AT] = bytes(_CHECKSUM_AT - end)
        _CHECKSUM.pack_into(buf, _CHECKSUM_AT, xxhash.xxh3_64_intdigest(buf[:_CHECKSUM_AT]))

    @classmethod
    def unpack(cls, buf: memoryview | bytes) -> RecordHeader:
        """Parse and check a header block; CorruptRecord if it is not one, FormatVersionError if newer."""
        if len(buf) < HEADER_BYTES:
            raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, f"header is {len(buf)} bytes")
        if bytes(buf[:8]) != MAGIC:
            raise CorruptRecord(QuarantineReason.HEADER, "bad magic")
        (stored_sum,) = _CHECKSUM.unpack_from(buf, _CHECKSUM_AT)
        if xxhash.xxh3_64_intdigest(buf[:_CHECKSUM_AT]) != stored_sum:
            raise CorruptRecord(QuarantineReason.HEADER, "header checksum mismatch")
        (_, version, hbytes, form, codec, glen, _flags, ns, bh, ld, group, plen, slen, rlen, created, psum, vklen) = (
            _FIXED.unpack_from(buf, 0)
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
                FORMS_BY_CODE[form],
                ld,
                Codec(codec),
                plen,
                slen,
                created,
                psum,
                bytes(buf[_FIXED.size : _FIXED.size + vklen]),
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise CorruptRecord(QuarantineReason.HEADER, f"unparseable field: {exc}") from None
        if hbytes != HEADER_BYTES or rlen != header.record_len or vklen > MAX_VERSION_KEY_BYTES:
            raise CorruptRecord(QuarantineReason.HEADER, "inconsistent lengths")
        return header

    def parsed_version_key(self) -> VersionKey:
        return VersionKey.from_dict(json.loads(self.version_key))

    def version_key_namespace(self) -> bytes | None:
        """The namespace the header's version key digests to (must equal `namespace`); None if unparseable."""
        try:
            return self.parsed_version_key().namespace
        except (ValueError, KeyError, TypeError):
            return None


def payload_checksum(data: memoryview | bytes) -> bytes:
    """xxh3_128 of the stored (post-codec) payload bytes."""
    return xxhash.xxh3_128_digest(data)


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
