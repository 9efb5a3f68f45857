"""The accounting one write transaction changes: bytes per form (`usage`), per namespace (`ns_usage`'s rows)
and each segment's row (`seg`).

Every change to a segment's tail, referenced bytes or record count goes through a Ledger, so the rule the
cleaner relies on (a sealed segment with nothing referenced can go once no reader predates its last drop) is
kept in one place; so does every record counted into or out of the usage, so a form's and a namespace's figures
move together.
"""

from __future__ import annotations

import dataclasses

import lmdb

from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.store.errors import CorruptRecord
from kvtier.store.index import Index, IndexEntry, SegmentEntry, Usage, u64_key
from kvtier.store.ns_usage import NAMESPACE_BYTES, NamespaceUsage, read_row, rows_current, save_rows


class Ledger:
    """Reads the rows it changes once, inside `txn`; `save` writes back what changed."""

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self._index = index
        self._txn = txn
        self._segments: dict[int, SegmentEntry] = {}
        self._usage: Usage | None = None
        self._rows: dict[bytes, NamespaceUsage] = {}
        self._keep_rows: bool | None = None  # whether the namespace rows are current (asked once, when first needed)

    @property
    def usage(self) -> Usage:
        if self._usage is None:
            self._usage = self._index.usage(self._txn)
        return self._usage

    def add(self, seg_id: int, offset: int, record_len: int) -> None:
        """A record now referenced at `offset` of `seg_id` (an allocated segment: its row exists)."""
        seg = self._segment(seg_id)
        assert seg is not None, f"segment {seg_id:016x} has no index row"
        self._segments[seg_id] = dataclasses.replace(
            seg,
            tail=max(seg.tail, align_up(offset + record_len, DISK_ALIGNMENT)),  # extents end padded to 4096
            referenced=seg.referenced + record_len,
            records=seg.records + 1,
        )

    def release(self, seg_id: int, record_len: int) -> None:
        """A record no longer referenced in `seg_id`; stamps the drop's txn id for the unlink epoch rule."""
        seg = self._segment(seg_id)
        if seg is None:
            return
        self._segments[seg_id] = dataclasses.replace(
            seg,
            referenced=max(0, seg.referenced - record_len),
            records=max(0, seg.records - 1),
            last_drop_txn=self._txn.id(),
        )

    def count(self, raw_key: bytes, form: CacheForm, lengths: tuple[int, int, int], sign: int) -> None:
        """A record (its object key; its record, payload and stored lengths) into (+1) or out of (-1) its form's
        and its namespace's usage."""
        record_len, payload_len, stored_len = lengths
        self.usage[form].add(record_len, payload_len, stored_len, sign)
        self._namespace(raw_key, sign, sign * record_len)

    def resize(self, raw_key: bytes, form: CacheForm, delta: int) -> None:
        """A record's bytes on disk changed by `delta` (a v1 record shrinks as it moves)."""
        if delta:
            self.usage[form].record_bytes += delta
            self._namespace(raw_key, 0, delta)

    def forget(self, raw_key: bytes, raw: bytes | memoryview) -> None:
        """Take an indexed record (its key and raw `obj` value) out of usage, the dirty list and its segment's
        counts; nothing to do when the value is corrupt (its bytes are unknown)."""
        try:
            old = IndexEntry.unpack(raw)
        except CorruptRecord:
            return
        self.count(raw_key, old.form, (old.record_len, old.payload_len, old.stored_len), -1)
        self._txn.delete(u64_key(old.seq), db=self._index.dirty)
        self.release(old.segment, old.record_len)

    def save(self) -> None:
        """Write back what changed; last in the transaction that changed it (the namespace rows' stamp covers
        `meta.seq` too, so a writer sets its next sequence number first)."""
        for seg_id, seg in self._segments.items():
            self._txn.put(u64_key(seg_id), seg.pack(), db=self._index.seg)
        if self._usage is not None:
            self._index.put_usage(self._txn, self._usage)
        if self._keep_rows and self._rows:
            save_rows(self._index, self._txn, self._rows)

    def _namespace(self, raw_key: bytes, records: int, nbytes: int) -> None:
        if self._keep_rows is None:
            self._keep_rows = rows_current(self._index, self._txn)  # the usage is still as the txn began
        if not self._keep_rows:
            return  # stale rows stay stale: the next writer's open counts them (`ns_usage.repair`)
        ns = raw_key[:NAMESPACE_BYTES]
        row = self._rows.get(ns)
        if row is None:
            try:
                row = self._rows[ns] = read_row(self._index, self._txn, ns)
            except CorruptRecord:
                self._keep_rows = False
                return
        row.records += records
        row.bytes += nbytes

    def _segment(self, seg_id: int) -> SegmentEntry | None:
        seg = self._segments.get(seg_id)
        if seg is None:
            seg = self._index.segment(self._txn, seg_id)
        return seg
