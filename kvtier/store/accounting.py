"""The accounting one write transaction changes: bytes per form (`usage`) and each segment's row (`seg`).

Every change to a segment's tail, referenced bytes or record count goes through a Ledger, so the rule the
cleaner relies on (a sealed segment with nothing referenced can go once no reader predates its last drop) is
kept in one place.
"""

from __future__ import annotations

import dataclasses

import lmdb

from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.store.errors import CorruptRecord
from kvtier.store.index import Index, IndexEntry, SegmentEntry, Usage, u64_key


class Ledger:
    """Reads the rows it changes once, inside `txn`; `save` writes back what changed."""

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self._index = index
        self._txn = txn
        self._segments: dict[int, SegmentEntry] = {}
        self._usage: Usage | None = None

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

    def forget(self, raw: bytes | memoryview) -> None:
        """Take an indexed record (its raw `obj` value) out of usage, the dirty list and its segment's counts;
        nothing to do when the value is corrupt (its bytes are unknown)."""
        try:
            old = IndexEntry.unpack(raw)
        except CorruptRecord:
            return
        self.usage[old.form].add(old.record_len, old.payload_len, old.stored_len, -1)
        self._txn.delete(u64_key(old.seq), db=self._index.dirty)
        self.release(old.segment, old.record_len)

    def save(self) -> None:
        for seg_id, seg in self._segments.items():
            self._txn.put(u64_key(seg_id), seg.pack(), db=self._index.seg)
        if self._usage is not None:
            self._index.put_usage(self._txn, self._usage)

    def _segment(self, seg_id: int) -> SegmentEntry | None:
        seg = self._segments.get(seg_id)
        if seg is None:
            seg = self._index.segment(self._txn, seg_id)
        return seg
