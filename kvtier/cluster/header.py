"""The header every cluster object starts with, and the object's name in the cluster.

A cluster can lose, truncate or mix objects (Mooncake drops objects from an over-full pool, loses them
all on a master restart without HA, and lets any client put any key), so each object names itself and
checksums its payload; a reader trusts only an object whose header matches what it asked for.

The disk store's `RecordHeader` is a 4096-byte block carrying the namespace's version key for index
rebuilds; a cluster object needs neither, so it has this 128-byte header of its own (format below).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import urllib.parse
from typing import Any

import xxhash

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey

MAGIC = b"KVTCLU\x00\x01"
FORMAT_VERSION = 1
HEADER_BYTES = 128
# Form codes are part of the object format, independent of enum order.
FORM_CODES: dict[CacheForm, int] = {CacheForm.COMPRESSED: 1, CacheForm.TAIL: 2, CacheForm.SWA: 3, CacheForm.INDEXER: 4}
_FORMS = {v: k for k, v in FORM_CODES.items()}

# magic, version, header bytes, form, group len, flags, namespace, block hash, layout digest, group, payload len,
# payload checksum (xxh3_128); then zero padding; the last 8 bytes are xxh3_64 of everything before them.
_FIXED = struct.Struct("<8sHHBBH16s16s16s32sQ16s")
_SEAL = struct.Struct("<Q")
_SEAL_AT = HEADER_BYTES - _SEAL.size


class Verdict(enum.Enum):
    """What a reader concludes from an object's bytes."""

    OK = "ok"
    TRUNCATED = "truncated"  # shorter than its header says (or than a header)
    OVERSIZED = "oversized"  # longer than its header says
    GARBAGE = "garbage"  # not a kvtier object: bad magic or header seal, newer format
    FOREIGN = "foreign"  # a valid object, but of another key
    LAYOUT = "layout"  # the right key in a layout (or size) the reader's kernels do not read
    CHECKSUM = "checksum"  # payload bytes differ from what the writer checksummed


def object_name(prefix: str, key: ObjectKey) -> str:
    """The cluster key: readable, parseable, one per (namespace, block hash, form, group)."""
    group = urllib.parse.quote(key.group, safe="")
    return f"{prefix}/{key.namespace.hex()}/{key.block_hash.hex()}/{key.form.value}/{group}"


def parse_name(prefix: str, name: str) -> ObjectKey | None:
    """Inverse of object_name; None for a name that is not a kvtier object under `prefix`."""
    parts = name.split("/")
    if len(parts) != 5 or parts[0] != prefix:
        return None
    try:
        return ObjectKey(
            bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), urllib.parse.unquote(parts[4]), CacheForm(parts[3])
        )
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectHeader:
    """What the writer states about the payload that follows the header."""

    key: ObjectKey
    layout_digest: bytes
    payload_len: int
    payload_checksum: bytes

    @classmethod
    def for_payload(cls, key: ObjectKey, layout_digest: bytes, payload: memoryview) -> ObjectHeader:
        return cls(key, layout_digest, len(payload), xxhash.xxh3_128_digest(payload))

    def pack_into(self, buf: memoryview) -> None:
        """Write the header into buf[:HEADER_BYTES]."""
        group = self.key.group.encode()
        fields: tuple[Any, ...] = (MAGIC, FORMAT_VERSION, HEADER_BYTES, FORM_CODES[self.key.form], len(group), 0)
        fields += (self.key.namespace, self.key.block_hash, self.layout_digest, group)
        buf[: _FIXED.size] = _FIXED.pack(*fields, self.payload_len, self.payload_checksum)
        buf[_FIXED.size : _SEAL_AT] = bytes(_SEAL_AT - _FIXED.size)
        _SEAL.pack_into(buf, _SEAL_AT, xxhash.xxh3_64_intdigest(buf[:_SEAL_AT]))


def verify_stored(obj: memoryview, key: ObjectKey) -> Verdict:
    """Check an object as stored, without a reader's layout (audits): its header against `key`, length, checksum."""
    if len(obj) >= HEADER_BYTES and bytes(obj[:8]) == MAGIC:
        fields = _FIXED.unpack_from(obj[:HEADER_BYTES])
        return verify(obj, key, fields[8], fields[10])
    return verify(obj, key, b"", 0)  # shorter than a header, or not a kvtier object: verify says which


def verify(obj: memoryview, key: ObjectKey, layout_digest: bytes, payload_len: int) -> Verdict:
    """Check an object read back for `key`: OK only if its payload, obj[HEADER_BYTES:], is exactly what was written."""
    if len(obj) < HEADER_BYTES:
        return Verdict.TRUNCATED
    head = obj[:HEADER_BYTES]
    if bytes(head[:8]) != MAGIC or xxhash.xxh3_64_intdigest(head[:_SEAL_AT]) != _SEAL.unpack_from(head, _SEAL_AT)[0]:
        return Verdict.GARBAGE
    _, version, hbytes, form, glen, _flags, ns, bh, digest, group, plen, checksum = _FIXED.unpack_from(head)
    if version != FORMAT_VERSION or hbytes != HEADER_BYTES:
        return Verdict.GARBAGE
    named = (ns, bh, _FORMS.get(form), group[:glen])
    if named != (key.namespace, key.block_hash, key.form, key.group.encode()):
        return Verdict.FOREIGN
    if digest != layout_digest or plen != payload_len:
        return Verdict.LAYOUT
    if len(obj) != HEADER_BYTES + plen:
        return Verdict.TRUNCATED if len(obj) < HEADER_BYTES + plen else Verdict.OVERSIZED
    if xxhash.xxh3_128_digest(obj[HEADER_BYTES:]) != checksum:
        return Verdict.CHECKSUM
    return Verdict.OK
