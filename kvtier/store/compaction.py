"""Segment maintenance: seal abandoned segments, unlink empty ones, trim crashed tails, relocate live records."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import lmdb

from kvtier.core.tier import ObjectKey
from kvtier.store.accounting import Ledger
from kvtier.store.context import StoreContext, entry_or_none
from kvtier.store.errors import CorruptRecord, QuarantineReason, StoreReadOnly
from kvtier.store.index import IndexEntry, RecordState, SegmentEntry, encode_key, u64_key
from kvtier.store.io import SegmentFile
from kvtier.store.maintenance import Maintenance
from kvtier.store.reader import Reader
from kvtier.store.segments import Appender, seal_segment, segment_name

_Copied = tuple[bytes, IndexEntry, int, int]  # (raw key, entry at the old place, new segment id, new offset)


class Compaction:
    """The segment side of the cleaner's work; relocation appends to segments of its own (never the daemon's)."""

    def __init__(self, ctx: StoreContext, reader: Reader, maintenance: Maintenance) -> None:
        self._ctx = ctx
        self._reader = reader
        self._maintenance = maintenance
        self._relocator: Appender | None = None

    def segments(self) -> dict[int, SegmentEntry]:
        with self._ctx.index.read() as txn:
            cursor = txn.cursor(db=self._ctx.index.seg)
            return {int.from_bytes(k, "big"): SegmentEntry.unpack(v) for k, v in cursor}

    def seal_abandoned_segments(self, owned: int) -> int:
        """Seal unsealed segments whose appender is gone (its flock is free), except `owned`; returns how many."""
        ctx = self._ctx
        stale = []
        for seg_id, entry in self.segments().items():
            if entry.sealed or seg_id == owned:
                continue
            try:
                probe = ctx.backend.open(os.path.join(ctx.seg_dir, segment_name(seg_id)))
            except FileNotFoundError:
                stale.append(seg_id)
                continue
            try:
                if probe.try_lock():
                    stale.append(seg_id)
            finally:
                probe.close()
        if stale:
            ctx.index.update(lambda txn: [seal_segment(ctx.index, txn, s) for s in stale])
        return len(stale)

    def try_unlink_segment(self, seg_id: int) -> bool:
        """Unlink a sealed segment that no record references, once no reader can still see a dropped record in it."""
        index = self._ctx.index
        with index.read() as txn:
            raw = txn.get(u64_key(seg_id), db=index.seg)
        if raw is None:
            return False
        entry = SegmentEntry.unpack(raw)
        if not entry.sealed or entry.referenced:
            return False
        oldest = index.oldest_reader_txnid()
        if oldest is not None and oldest < entry.last_drop_txn:
            return False
        path = os.path.join(self._ctx.seg_dir, segment_name(seg_id))
        probe = _lock_segment(path)
        if probe is False:
            return False  # an appender still holds it (a segment rolled mid-batch is sealed before its batch commits)

        def put(txn: lmdb.Transaction) -> bool:
            cur = txn.get(u64_key(seg_id), db=index.seg)
            if cur is None or bytes(cur) != bytes(raw):
                return False
            txn.delete(u64_key(seg_id), db=index.seg)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return True

        try:
            return index.update(put)
        finally:
            if probe is not None:
                probe.close()

    def trim_segment(self, seg_id: int) -> int:
        """Cut a sealed segment's uncommitted tail (bytes a crashed batch left past `tail`); returns bytes freed."""
        probe = _lock_segment(os.path.join(self._ctx.seg_dir, segment_name(seg_id)))
        if not isinstance(probe, SegmentFile):
            return 0
        try:
            with self._ctx.index.read() as txn:  # read under the flock: every batch that wrote this file has committed
                entry = self._ctx.index.segment(txn, seg_id)
            size = probe.size()
            if entry is None or not entry.sealed or size <= entry.tail:
                return 0
            probe.truncate(entry.tail)
            probe.sync()
            return size - entry.tail
        finally:
            probe.close()

    def relocate(self, keys: Sequence[ObjectKey]) -> int:
        """Compaction: copy live records verbatim (checked first) into a segment this process appends, then repoint
        each entry that still names the old place, in one commit; returns how many moved. A bad record is quarantined.

        The old bytes stay readable until their segment is unlinked under the epoch rule, so a reader that looked
        the old entry up finishes on it; a record that changed meanwhile keeps its entry (its copy is garbage).
        """
        ctx = self._ctx
        if ctx.readonly:
            raise StoreReadOnly("relocate() needs a store opened for maintenance (not read-only)")
        if self._relocator is None:
            self._relocator = Appender(ctx.root, ctx.index, ctx.backend, ctx.config.segment_bytes)
        app = self._relocator
        failures: list[tuple[ObjectKey, QuarantineReason]] = []
        written: list[_Copied] = []
        moved = 0
        with ctx.write_lock:
            app.begin_batch()
            synced = False
            try:
                with ctx.index.read() as txn:  # an epoch: the source segments cannot be unlinked while we copy
                    for key in keys:
                        raw_key = encode_key(key)
                        raw = txn.get(raw_key, db=ctx.index.obj)
                        entry = entry_or_none(raw) if raw is not None else None
                        if entry is None or entry.state is not RecordState.LIVE:
                            continue
                        try:
                            buf = self._reader.fetch_checked(key, entry, self._reader.segment(entry.segment))
                        except CorruptRecord as exc:
                            failures.append((key, exc.reason))
                            continue
                        try:
                            place = app.place(entry.record_len)
                            place.file.pwrite_all(buf.mv[: entry.record_len], place.offset)
                        finally:
                            ctx.buffers.release(buf)
                        written.append((raw_key, entry, place.seg_id, place.offset))
                if written:
                    app.sync_batch()
                    synced = True
                    moved = ctx.index.update(lambda txn: self._repoint(txn, written))
            except BaseException:
                app.rewind(abandon=bool(written) and not synced)
                raise
            finally:
                app.end_batch()
        self._maintenance.quarantine_faults(failures)
        return moved

    def _repoint(self, txn: lmdb.Transaction, written: list[_Copied]) -> int:
        obj_db = self._ctx.index.obj
        ledger = Ledger(self._ctx.index, txn)
        moved = 0
        for raw_key, old, seg_id, offset in written:
            raw = txn.get(raw_key, db=obj_db)
            cur = entry_or_none(raw) if raw is not None else None
            if (
                cur is None
                or cur.state is not RecordState.LIVE
                or (cur.segment, cur.offset, cur.seq) != (old.segment, old.offset, old.seq)
            ):
                continue
            txn.put(raw_key, dataclasses.replace(cur, segment=seg_id, offset=offset).pack(), db=obj_db)
            ledger.release(old.segment, old.record_len)
            ledger.add(seg_id, offset, old.record_len)
            moved += 1
        ledger.save()
        return moved

    def close(self) -> None:
        if self._relocator is not None:
            self._relocator.close()
            self._relocator = None


def _lock_segment(path: str) -> SegmentFile | bool | None:
    """The segment opened with its flock taken; None if the file is gone; False if another holder has it."""
    try:
        probe = SegmentFile(path, os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        return None
    if probe.try_lock():
        return probe
    probe.close()
    return False
