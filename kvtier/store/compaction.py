"""Segment maintenance: seal abandoned segments, unlink empty ones, trim crashed tails, relocate live records."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterable, Sequence
from typing import Literal

import lmdb

from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.store.accounting import Ledger
from kvtier.store.context import StoreContext, entry_or_none
from kvtier.store.decisions import AllocateSegment, Move, Repoint, SealSegment
from kvtier.store.errors import CorruptRecord, QuarantineReason, StoreReadOnly
from kvtier.store.extent import BACKGROUND_IO_BYTES, ExtentPlan, write_extent
from kvtier.store.gil import Piece, in_pieces
from kvtier.store.header_check import AnyHeader
from kvtier.store.index import Index, IndexEntry, NamespaceEntry, RecordState, SegmentEntry, encode_key, u64_key
from kvtier.store.io import SegmentFile, cut_down
from kvtier.store.maintenance import Maintenance
from kvtier.store.reader import Reader
from kvtier.store.record import FORMAT_VERSION, Flags, RecordHeader, namespace_record
from kvtier.store.scan import ScanItem
from kvtier.store.segments import Appender, allocate_segment, seal_segment, segment_name


@dataclasses.dataclass(frozen=True, slots=True)
class _Copy:
    """A checked record read for relocation: its key, its entry where it was read, its v2 header and bytes."""

    raw_key: bytes
    entry: IndexEntry
    header: RecordHeader
    data: bytes  # its stored bytes (plain bytes: the verifier, which compacts, never loads torch)


@dataclasses.dataclass(frozen=True, slots=True)
class _Moved:
    copy: _Copy
    seg_id: int
    offset: int


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

    def abandoned_segments(self, owned: int) -> list[int]:
        """Unsealed segments, other than `owned`, whose appender is gone (its flock is free, or the file is): read
        only, so the verifier finds them in its own process and the daemon only re-probes what it names."""
        return [
            seg_id
            for seg_id, entry in self.segments().items()
            if not entry.sealed and seg_id != owned and self._appender_gone(seg_id)
        ]

    def seal_abandoned(self, seg_ids: Sequence[int], owned: int) -> int:
        """Seal those of `seg_ids` still unsealed whose appender is still gone, except `owned`; returns how many.
        Each is probed again: the sender may have found one allocated and not yet created, which its appender has
        created and locked since (an appender that finds its new segment sealed takes another, `Appender._roll`)."""
        stale = [s for s in seg_ids if s != owned and self._appender_gone(s)]
        if not stale:
            return 0
        index = self._ctx.index
        return int(index.update(lambda txn: sum(seal_segment(index, txn, s) for s in stale)))

    def _appender_gone(self, seg_id: int) -> bool:
        """Whether no appender holds the segment's flock (a missing file has none)."""
        ctx = self._ctx
        try:
            probe = ctx.backend.open(os.path.join(ctx.seg_dir, segment_name(seg_id)))
        except FileNotFoundError:
            return True
        try:
            return bool(probe.try_lock())
        finally:
            probe.close()

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

        # The file goes before the entry, outside the write transaction: freeing a large file's extents can take
        # the filesystem long enough to hold up every durable offload queued on the write lock; and it goes in
        # synced steps, cut through the probe that holds its flock (`cut_down`: on a discard mount each step's
        # extents are discarded in a commit of their own). A crash part way leaves the entry with a shorter file, or
        # none, which the next call deletes. Nothing can come to reference a sealed segment meanwhile (writers append
        # only to unsealed ones and relocation moves records out of segments, never into a sealed one), and no
        # reader can still read it (the epoch rule above), so cutting it short is as safe as unlinking it.
        try:
            if probe is not None:
                cut_down(probe.fd, 0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        finally:
            if probe is not None:
                probe.close()

        def put(txn: lmdb.Transaction) -> bool:
            cur = txn.get(u64_key(seg_id), db=index.seg)
            if cur is None or bytes(cur) != bytes(raw):
                return False
            txn.delete(u64_key(seg_id), db=index.seg)
            return True

        return index.update(put)

    def trim_segment(self, seg_id: int) -> int:
        """Cut a sealed segment's uncommitted tail (bytes a crashed batch left past `tail`), in synced steps as a
        segment is deleted (`cut_down`); returns bytes freed."""
        probe = _lock_segment(os.path.join(self._ctx.seg_dir, segment_name(seg_id)))
        if not isinstance(probe, SegmentFile):
            return 0
        try:
            with self._ctx.index.read() as txn:  # read under the flock: every batch that wrote this file has committed
                entry = self._ctx.index.segment(txn, seg_id)
            size = probe.size()
            if entry is None or not entry.sealed or size <= entry.tail:
                return 0
            cut_down(probe.fd, entry.tail)
            probe.truncate(entry.tail)
            probe.sync()
            return size - entry.tail
        finally:
            probe.close()

    def relocate(self, batches: Iterable[Sequence[ObjectKey]]) -> list[int]:
        """Compaction: copy the live records of each batch of keys (checked first) into extents of a segment this
        process appends; then make every copy durable with one fdatasync and repoint each entry that still names
        the old place in one commit (on the daemon's applier thread, one per `gil.Piece`). Returns how many moved,
        per batch. A bad record is quarantined. Format v1
        records move as v2 records (same payload and checksum, inline header).

        `batches` is drawn one batch at a time, between copies: the caller paces the copies by when it yields the
        next batch, and the sync and the commit, each a device flush that the store's readers feel, come once
        for all of them. A crash before the commit leaves the copies as an orphan tail, trimmed later. The store's
        append lock is held from the first batch to the commit, pacing included: a `store_many` of this process
        waits meanwhile (the cleaner, the one caller, runs in the verifier, which stores nothing).

        The old bytes stay readable until their segment is unlinked under the epoch rule, so a reader that looked
        the old entry up finishes on it; a record that changed meanwhile keeps its entry (its copy is garbage).
        """
        ctx = self._ctx
        if ctx.readonly:
            raise StoreReadOnly("relocate() needs a store opened for maintenance (not read-only)")
        if self._relocator is None:
            self._relocator = Appender(
                ctx.root,
                ctx.index,
                ctx.backend,
                ctx.config.segment_bytes,
                allocate=lambda: int(ctx.decide(AllocateSegment())),
                seal=lambda seg_id: ctx.decide(SealSegment(seg_id)),
            )
        app = self._relocator
        written: list[list[_Moved]] = []
        failures: list[tuple[ObjectKey, QuarantineReason]] = []
        with ctx.write_lock:
            app.begin_batch()
            synced = False
            try:
                for keys in batches:
                    copies, namespaces, failed = self._read_for_relocation(keys)
                    failures += failed
                    written.append([w for part in _cut(copies) for w in self._write_copies(part, namespaces)])
                moved = [0] * len(written)
                if any(written):
                    app.sync_batch()
                    synced = True
                    moved = [int(n) for n in ctx.decide(Repoint([[_move(w) for w in batch] for batch in written]))]
            except BaseException:
                app.rewind(abandon=not synced)
                raise
            finally:
                app.end_batch()
        self._maintenance.quarantine_faults(failures)
        return moved

    def _read_for_relocation(
        self, keys: Sequence[ObjectKey]
    ) -> tuple[list[_Copy], dict[bytes, VersionKey], list[tuple[ObjectKey, QuarantineReason]]]:
        """Read and check the live records of `keys` into memory, in one read transaction (an epoch: their
        segments cannot be unlinked meanwhile) that closes before anything is written. Writing may roll a
        segment, whose write transaction may grow the LMDB map, and growing the map waits for every read
        transaction of this process: one held here would wait for itself (issue 18)."""
        index = self._ctx.index
        copies: list[_Copy] = []
        namespaces: dict[bytes, VersionKey] = {}
        failures: list[tuple[ObjectKey, QuarantineReason]] = []
        with index.read() as txn:
            items: list[ScanItem] = []
            for key in keys:
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=index.obj)
                entry = entry_or_none(raw) if raw is not None else None
                if entry is None or entry.state is not RecordState.LIVE:
                    continue
                if key.namespace not in namespaces:
                    ns = _namespace_or_none(index, txn, key.namespace)
                    if ns is None:
                        continue  # no version key to make the new extent self-describing: the record stays
                    namespaces[key.namespace] = ns.version_key
                items.append(ScanItem(key, entry, raw_key))

            def keep(number: int, header: AnyHeader | None, mv: memoryview, at: int) -> None:
                assert header is not None
                item = items[number]
                data = bytes(mv[at : at + item.entry.stored_len])
                copies.append(_Copy(item.raw_key, item.entry, _as_v2(header, item.entry), data))

            for number, exc in self._reader.scan(txn, items, keep, headers=True):
                failures.append((items[number].key, exc.reason))
        copies.sort(key=lambda c: (c.entry.segment, c.entry.offset))  # keep neighbours neighbours
        return copies, namespaces, failures

    def _write_copies(self, copies: list[_Copy], namespaces: dict[bytes, VersionKey]) -> list[_Moved]:
        ctx = self._ctx
        assert self._relocator is not None
        now = time.time()
        ns_records = [namespace_record(namespaces[ns], now) for ns in dict.fromkeys(c.header.namespace for c in copies)]
        records: list[tuple[RecordHeader, bytes]] = [*ns_records, *((c.header, c.data) for c in copies)]
        seg_id, offsets = write_extent(
            self._relocator, ctx.backend, ctx.buffers, records, None, piece_bytes=BACKGROUND_IO_BYTES
        )
        return [_Moved(c, seg_id, at) for c, at in zip(copies, offsets[len(ns_records) :])]

    def apply_allocate(self) -> int:
        return self._ctx.index.update(lambda txn: allocate_segment(self._ctx.index, txn))

    def apply_seal(self, d: SealSegment) -> None:
        self._ctx.index.update(lambda txn: seal_segment(self._ctx.index, txn, d.seg_id))

    def apply_repoint(self, d: Repoint) -> list[int]:
        """Repoint every moved record that still lies where it was read; how many per batch. One commit, or on the
        applier's thread one per piece (`kvtier.store.gil.Piece`): each move is checked and counted on its own, so
        a decision cut anywhere leaves every record pointing at a durable copy."""
        moves = [(i, m) for i, batch in enumerate(d.batches) for m in batch]
        repoint = functools.partial(self._repoint, moves=moves, n=len(d.batches))
        pieces = in_pieces(lambda at: self._ctx.index.update(functools.partial(repoint, start=at)), len(moves))
        return [sum(col) for col in zip(*pieces)]  # per batch, over the pieces (there is always one)

    def _repoint(
        self, txn: lmdb.Transaction, moves: list[tuple[int, Move]], start: int, n: int
    ) -> tuple[list[int], int]:
        """Moves from `start` on, until the piece is over; returns how many it moved of each of the `n` batches
        and where it stopped."""
        obj_db = self._ctx.index.obj
        ledger = Ledger(self._ctx.index, txn)
        piece = Piece(self._ctx.index.writers)
        mine = [0] * n
        at = start
        while at < len(moves) and not piece.over():
            i, m = moves[at]
            at += 1
            raw = txn.get(m.key, db=obj_db)
            cur = entry_or_none(raw) if raw is not None else None
            if (
                cur is None
                or cur.state is not RecordState.LIVE
                or (cur.segment, cur.offset, cur.seq) != (m.old_segment, m.old_offset, m.old_seq)
            ):
                continue
            entry = dataclasses.replace(
                cur, segment=m.segment, offset=m.offset, record_len=m.record_len, record_version=FORMAT_VERSION
            )
            txn.put(m.key, entry.pack(), db=obj_db)
            ledger.release(cur.segment, cur.record_len)
            ledger.add(m.segment, m.offset, m.record_len)
            ledger.resize(m.key, cur.form, m.record_len - cur.record_len)
            mine[i] += 1
        ledger.save()
        return mine, at

    def close(self) -> None:
        if self._relocator is not None:
            self._relocator.close()
            self._relocator = None


def _move(w: _Moved) -> Move:
    old = w.copy.entry
    return Move(w.copy.raw_key, old.segment, old.offset, old.seq, w.seg_id, w.offset, w.copy.header.record_len)


def _lock_segment(path: str) -> SegmentFile | Literal[False] | None:
    """The segment opened with its flock taken; None if the file is gone; False if another holder has it."""
    try:
        probe = SegmentFile(path, os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        return None
    if probe.try_lock():
        return probe
    probe.close()
    return False


def _as_v2(h: AnyHeader, entry: IndexEntry) -> RecordHeader:
    """The record's v2 header: the same identity, payload checksums and creation time, wherever it lies."""
    assert h.form is not None
    return RecordHeader(
        h.namespace,
        h.block_hash,
        h.group,
        h.form,
        h.layout_digest,
        h.codec,
        h.payload_len,
        h.stored_len,
        h.created,
        Flags(entry.flags),
        h.payload_checksum,
        h.device_checksum,
    )


def _namespace_or_none(index: Index, txn: lmdb.Transaction, ns: bytes) -> NamespaceEntry | None:
    try:
        return index.namespace(txn, ns)
    except CorruptRecord:
        return None


def _cut(copies: list[_Copy]) -> list[list[_Copy]]:
    """Copies in extents of about MAX_EXTENT_BYTES, in order."""
    parts: list[list[_Copy]] = []
    plan = ExtentPlan()
    for c in copies:
        if not parts or not plan.fits(c.header.stored_len):
            parts.append([])
            plan = ExtentPlan()
        plan.add(c.header.stored_len)
        parts[-1].append(c)
    return parts
