"""One record checked on the bytes the pipeline already read into its bounce buffer: the per-record step that names
why a record failed (its quarantine reason), and accepts the few records the batch check does not take.

Contract:
- `check_record(entry, key, buf, at, read_whole, header_ok, headers=False)` checks the record at offset `at` of `buf`
  (its index entry, its key): read whole (else `segment_truncated`); its header (v2: `header_ok`, the result of
  `header_check.headers_good` for it; v1: `header_check.check_v1`), a v2 header that fails named by
  `header_check.fault`; then `check_sums` over the stored payload. Returns the parsed header (v2 only where
  `headers=True`; v1 always) and where the stored payload starts in `buf`; CorruptRecord naming the reason.
- `check_sums(entry, buf, at)`: every payload checksum the record carries that the host computes cheaply
  (xxh3_128, else the device checksum on cpu).
- `entry_rows(entries)`: IndexEntry objects (any record format) as ENTRY_V2_DTYPE rows, every field but the seal:
  the columns the pipeline plans and checks with, and those an index walk counts (`index_page`).

Why here and not in a read path: every record is read once, by the pipeline (`packed.PackedLoad`, `scan.PackedScan`);
this never reads, it only looks at what was read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.core.tier import ObjectKey
from kvtier.store.devsum import device_checksum
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.header_check import AnyHeader, check_v1, fault
from kvtier.store.index import ENTRY_V2_DTYPE, IndexEntry
from kvtier.store.io import AlignedBuffer
from kvtier.store.record import FORM_CODES, FORMAT_VERSION, HEADER_BYTES, Flags, RecordHeader, payload_checksum
from kvtier.store.record_v1 import V1_HEADER_BYTES

_XXH3 = int(Flags.XXH3)


def check_record(
    entry: IndexEntry,
    key: ObjectKey,
    buf: AlignedBuffer,
    at: int,
    read_whole: bool,
    header_ok: bool,
    headers: bool = False,
) -> tuple[AnyHeader | None, int]:
    """The record's header (or None) and where its stored payload starts in `buf` (the module docstring)."""
    mv = buf.mv
    if not read_whole:
        raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, f"segment {entry.segment:016x} ends inside the record")
    header: AnyHeader | None
    if entry.record_version == FORMAT_VERSION:
        if not header_ok:
            raise fault(entry, key, mv, at)  # (it only names what is wrong: the batch check refused the header)
        header = RecordHeader.unpack(mv, at) if headers else None
        payload_at = at + HEADER_BYTES
    else:
        header = check_v1(entry, key, mv, at)
        payload_at = at + V1_HEADER_BYTES
    check_sums(entry, buf, payload_at)
    return header, payload_at


def check_sums(entry: IndexEntry, buf: AlignedBuffer, at: int) -> None:
    """Every checksum the record carries that the host can compute cheaply over its stored payload (`buf` from
    `at`): xxh3, else the device sum on cpu. Only the device sum takes the buffer as a tensor: a process that
    checks xxh3 records (the verifier) never loads torch for it."""
    if entry.flags & _XXH3:
        if payload_checksum(buf.mv[at : at + entry.stored_len]) != entry.payload_checksum:
            raise CorruptRecord(QuarantineReason.PAYLOAD, "payload checksum mismatch")
    elif device_checksum(buf.tensor[at : at + entry.stored_len]) != entry.device_checksum:
        raise CorruptRecord(QuarantineReason.PAYLOAD, "payload device checksum mismatch")


def entry_rows(entries: Sequence[IndexEntry]) -> np.ndarray:
    """IndexEntry objects as ENTRY_V2_DTYPE rows (the module docstring)."""
    rows = np.zeros(len(entries), ENTRY_V2_DTYPE)
    if not entries:
        return rows
    for name in (
        "segment",
        "offset",
        "record_len",
        "payload_len",
        "stored_len",
        "seq",
        "created",
        "verified_at",
        "pin_until",
        "quarantined_at",
        "device_checksum",
        "quarantine_reason",
    ):
        rows[name] = [getattr(e, name) for e in entries]
    rows["form"] = [FORM_CODES[e.form] for e in entries]
    rows["codec"] = [int(e.codec) for e in entries]
    rows["flags"] = [e.flags for e in entries]
    rows["version"] = [e.record_version for e in entries]
    rows["state"] = [int(e.state) for e in entries]
    rows["payload_checksum"] = np.frombuffer(b"".join([e.payload_checksum for e in entries]), "V16")
    rows["layout_digest"] = np.frombuffer(b"".join([e.layout_digest for e in entries]), "V16")
    return rows
