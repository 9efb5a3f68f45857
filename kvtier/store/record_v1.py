"""Format v1 records (4096-byte header block, payload padded to 4096 B): read, verified and rebuilt, never written.

Stores written before the extent layout (FORMAT.md, "Format v1 records") keep these records until the cleaner
compacts or evicts them; their index entries carry record version 1 and are read through this header.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import xxhash

from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.core.versions import VersionKey
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.record import FORMS_BY_CODE, Codec

V1_MAGIC = b"KVTREC\x00\x01"
V1_HEADER_BYTES = DISK_ALIGNMENT

# magic, version, header bytes, form, codec, group len, flags, namespace, block hash, layout digest, group,
# payload len, stored len, record len, created, payload checksum (xxh3_128), version-key json len
_FIXED = struct.Struct("<8sHHBBBB16s16s16s32sQQQd16sH")
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = V1_HEADER_BYTES - _CHECKSUM.size
_MAX_VERSION_KEY_BYTES = _CHECKSUM_AT - _FIXED.size


def v1_record_length(stored_len: int) -> int:
    """Bytes a v1 record occupies: header block plus payload padded to 4096."""
    return V1_HEADER_BYTES + align_up(stored_len, DISK_ALIGNMENT)


@dataclasses.dataclass(frozen=True, slots=True)
class RecordHeaderV1:
    """A v1 header block: everything needed to index the record, including its namespace's version key."""

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

    record_version = 1
    header_bytes = V1_HEADER_BYTES
    flags = 1  # xxh3 only (Flags.XXH3)
    device_checksum = 0

    @property
    def record_len(self) -> int:
        return v1_record_length(self.stored_len)

    @classmethod
    def unpack(cls, buf: memoryview | bytes) -> RecordHeaderV1:
        """Parse and check a v1 header block; CorruptRecord if it is not one."""
        if len(buf) < V1_HEADER_BYTES:
            raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, f"header is {len(buf)} bytes")
        if bytes(buf[:8]) != V1_MAGIC:
            raise CorruptRecord(QuarantineReason.HEADER, "bad magic")
        (stored_sum,) = _CHECKSUM.unpack_from(buf, _CHECKSUM_AT)
        if xxhash.xxh3_64_intdigest(buf[:_CHECKSUM_AT]) != stored_sum:
            raise CorruptRecord(QuarantineReason.HEADER, "header checksum mismatch")
        (_, version, hbytes, form, codec, glen, _flags, ns, bh, ld, group, plen, slen, rlen, created, psum, vklen) = (
            _FIXED.unpack_from(buf, 0)
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
        if version != 1 or hbytes != V1_HEADER_BYTES or rlen != header.record_len or vklen > _MAX_VERSION_KEY_BYTES:
            raise CorruptRecord(QuarantineReason.HEADER, "inconsistent lengths")
        return header

    def version_key_namespace(self) -> bytes | None:
        """The namespace the header's version key digests to (must equal `namespace`); None if unparseable."""
        try:
            return VersionKey.from_dict(json.loads(self.version_key)).namespace
        except (ValueError, KeyError, TypeError):
            return None
