"""The one check of record headers on the read path: a batch of records' header bytes against the bytes their keys
and index entries imply, at once; and, for a record that fails it, why.

Contract:
- `expected_headers(entries, keys)` builds, from the header dtype, the v2 header each record must begin with:
  `entries` holds at least the fields of ENTRY_FIELDS per record (ENTRY_V2_DTYPE rows as they lie in the index,
  or `record_check.entry_rows` of IndexEntry objects), `keys` the records' encoded index keys. The checksum field is
  left 0: the check hashes the bytes read.
- `headers_good(mv, at, expected)` (`expected`: HEADER_DTYPE rows, or their bytes as rows of a uint8 array) says
  per record whether the HEADER_BYTES at offset `at[i]` of `mv` equal `expected[i]` in every byte before the
  checksum and the checksum there is xxh3_64 of those bytes (a few records are compared one by one, `header_good`).
  This is the only check that accepts a v2 header; the one read path (the batch pipeline: loads, GDS rows and scans)
  runs it against headers built here.
- `fault(entry, key, mv, at)` names why a record is bad, as the quarantine reason a `CorruptRecord` carries: a
  header that does not parse (damaged: `header`, or its bytes cut short: `segment_truncated`), one that parses but
  names another key or entry, or differs in any byte (`header_mismatch`). It runs only for a record the check
  refused: it never accepts one. A v1 record's 4 KiB header block (its own layout) is parsed and compared field by
  field by `check_v1`.
- A v2 header of a version newer than this kvtier reads raises FormatVersionError from `fault`, as the store does
  on open: the record is not guessed at.

Why one check: the record format is described once (HEADER_DTYPE, beside the writer's struct in record.py), so a
change to it changes one builder and one comparison; and a vectorised compare of a batch's headers costs less than
one Python step per record.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import xxhash

from kvtier.core.tier import ObjectKey
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.index import ENTRY_V2_DTYPE, KEY_PREFIX_BYTES, IndexEntry
from kvtier.store.record import (
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    RECORD_ALIGNMENT,
    RecordHeader,
    leading_h64,
)
from kvtier.store.record_v1 import V1_HEADER_BYTES, RecordHeaderV1

AnyHeader = RecordHeader | RecordHeaderV1

# The index entry's fields a header repeats (the rest of the header comes from the key).
ENTRY_FIELDS = np.dtype(
    [
        (name, ENTRY_V2_DTYPE[name])
        for name in (
            "codec",
            "flags",
            "layout_digest",
            "payload_len",
            "stored_len",
            "created",
            "payload_checksum",
            "device_checksum",
        )
    ]
)
_KEY_PREFIX = np.dtype([("namespace", "V16"), ("block_hash", "V16"), ("form", "u1")])  # encode_key's first bytes
assert _KEY_PREFIX.itemsize == KEY_PREFIX_BYTES
_FIXED = HEADER_BYTES - 8  # the header's bytes before its checksum
_FIXED_WORDS = _FIXED // 8
_ROW = np.dtype(f"V{RECORD_ALIGNMENT}")
_HEADER_ROWS = np.arange(HEADER_BYTES // RECORD_ALIGNMENT)
_HEADER_SPAN = np.arange(HEADER_BYTES)
assert HEADER_BYTES % RECORD_ALIGNMENT == 0 and _FIXED % 8 == 0
_h64 = xxhash.xxh3_64_intdigest
_PREFIX_OF = operator.itemgetter(slice(KEY_PREFIX_BYTES))  # an encoded key's namespace, block hash and form
_GROUP_OF = operator.itemgetter(slice(KEY_PREFIX_BYTES, None))
_FEW = 4  # up to this many records are compared one by one


def expected_headers(entries: np.ndarray, keys: Sequence[bytes]) -> np.ndarray:
    """Per record, the v2 header its encoded key and index entry imply (the checksum field 0)."""
    n = len(keys)
    h = np.zeros(n, HEADER_DTYPE)
    # (C-level maps, not a Python step per key: these run per object of every load)
    prefix = np.frombuffer(b"".join(map(_PREFIX_OF, keys)), _KEY_PREFIX)
    groups = list(map(_GROUP_OF, keys))
    h["magic"] = np.void(MAGIC)
    h["version"] = FORMAT_VERSION
    h["form"] = prefix["form"]
    h["codec"] = entries["codec"]
    h["group_len"] = np.fromiter(map(len, groups), np.uint8, n)
    h["flags"] = entries["flags"]
    h["header_bytes"] = HEADER_BYTES
    h["namespace"] = prefix["namespace"]
    h["block_hash"] = prefix["block_hash"]
    h["layout_digest"] = entries["layout_digest"]
    h["group"] = groups
    for field in ("payload_len", "stored_len", "created", "payload_checksum", "device_checksum"):
        h[field] = entries[field]
    return h


def headers_good(mv: memoryview, at: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Whether each record's header bytes in `mv` (from `at`) are exactly `expected`'s and carry a good checksum.
    Every header must lie wholly inside `mv` (the caller has checked the record was read whole)."""
    n = len(at)
    if n <= _FEW:  # a few records: the same comparison one by one costs less than setting up the arrays
        want_bytes = expected.tobytes()
        return np.fromiter(
            (
                header_good(mv, p, want_bytes[i * HEADER_BYTES : i * HEADER_BYTES + _FIXED])
                for i, p in enumerate(at.tolist())
            ),
            bool,
            n,
        )
    buf = np.frombuffer(mv, np.uint8)
    if not (at % RECORD_ALIGNMENT).any():
        # Headers 32-aligned (runs start 4096-aligned, records 32-aligned in their file): gathered as 32-byte rows,
        # five indexes a header where a byte gather takes 160.
        rows = (at // RECORD_ALIGNMENT)[:, None] + _HEADER_ROWS
        got = buf[: len(buf) - len(buf) % RECORD_ALIGNMENT].view(_ROW)[rows].view(np.uint8).reshape(-1, HEADER_BYTES)
    else:
        got = buf[at[:, None] + _HEADER_SPAN]
    want = expected.view(np.uint64).reshape(len(at), -1)
    good = (got.view(np.uint64)[:, :_FIXED_WORDS] == want[:, :_FIXED_WORDS]).all(axis=1)
    return good & (leading_h64(got, _FIXED) == got.view(HEADER_DTYPE)[:, 0]["checksum"])


def header_good(mv: memoryview, at: int, expected: bytes) -> bool:
    """`headers_good` for one record, `expected` its expected header's bytes before the checksum (a batch of a few
    records costs less so than gathered)."""
    fixed = mv[at : at + _FIXED]
    return fixed == expected and _h64(fixed) == int.from_bytes(mv[at + _FIXED : at + HEADER_BYTES], "little")


def parse_header(entry: IndexEntry, mv: memoryview, at: int) -> AnyHeader:
    """The record's header as its format lays it out; CorruptRecord if it does not parse."""
    if entry.record_version == 1:
        return RecordHeaderV1.unpack(mv[at : at + V1_HEADER_BYTES])
    return RecordHeader.unpack(mv, at)


def fault(entry: IndexEntry, key: ObjectKey, mv: memoryview, at: int) -> CorruptRecord:
    """Why the record at `at` is bad (the module docstring says when it is asked)."""
    try:
        header = parse_header(entry, mv, at)
    except CorruptRecord as exc:
        return exc
    return _mismatch(header, key, entry) or CorruptRecord(
        QuarantineReason.HEADER_MISMATCH, "record header bytes differ from those its key and index entry imply"
    )


def check_v1(entry: IndexEntry, key: ObjectKey, mv: memoryview, at: int) -> RecordHeaderV1:
    """A v1 record's header block parsed and checked against its key and entry (its own layout: no batch check)."""
    header = RecordHeaderV1.unpack(mv[at : at + V1_HEADER_BYTES])
    mismatch = _mismatch(header, key, entry)
    if mismatch is not None:
        raise mismatch
    return header


def _mismatch(h: AnyHeader, key: ObjectKey, e: IndexEntry) -> CorruptRecord | None:
    if (
        h.namespace != key.namespace
        or h.block_hash != key.block_hash
        or h.group != key.group
        or h.form is not key.form
        or h.layout_digest != e.layout_digest
        or h.codec is not e.codec
        or h.payload_len != e.payload_len
        or h.stored_len != e.stored_len
        or h.payload_checksum != e.payload_checksum
        or h.record_version != e.record_version
        or int(h.flags) != e.flags
        or h.device_checksum != e.device_checksum
    ):
        return CorruptRecord(QuarantineReason.HEADER_MISMATCH, "record header does not match its index entry")
    return None
