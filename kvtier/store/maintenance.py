"""Maintenance (the verifier and cleaner's primitives): removal and tombstones, quarantine, verification, scans."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

import lmdb

from kvtier.core.forms import Reason
from kvtier.core.tier import ObjectKey
from kvtier.store.accounting import Ledger
from kvtier.store.context import StoreContext, atime_or_zero, entry_or_none, key_str
from kvtier.store.decisions import Drop, DropIf, PruneTombstones, Quarantine, Stamp
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.gil import Piece, in_pieces
from kvtier.store.index import (
    Index,
    IndexEntry,
    RecordState,
    decode_key,
    encode_key,
    pack_time,
    u64_key,
    unpack_time,
)
from kvtier.store.index_page import IndexPage
from kvtier.store.reader import Reader
from kvtier.store.record import Codec
from kvtier.store.scan import ScanItem

log = logging.getLogger(__name__)

DropFilter = Callable[[ObjectKey, IndexEntry | None], bool]


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyResult:
    """One record's check: what a load would answer now, and the fault this check found (None: none)."""

    reason: Reason
    failure: QuarantineReason | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RecordInfo:
    """One row of a maintenance scan; `entry` is None when the index value itself is corrupt."""

    key: ObjectKey
    entry: IndexEntry | None
    atime: float


class Maintenance:
    """Changes to records that are not writes of new ones, and the scans the verifier makes."""

    def __init__(self, ctx: StoreContext, reader: Reader) -> None:
        self._ctx = ctx
        self._reader = reader

    # ----------------------------------------------------------------- pins and removal

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> int:
        """Protect records from eviction until now + ttl_s (extends, never shortens); returns how many exist."""
        index = self._ctx.index
        until = time.time() + ttl_s

        def put(txn: lmdb.Transaction) -> int:
            found = 0
            for key in keys:
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=index.obj)
                entry = entry_or_none(raw) if raw is not None else None
                if entry is None:
                    continue
                found += 1
                if entry.pin_until < until:
                    txn.put(raw_key, dataclasses.replace(entry, pin_until=until).pack(), db=index.obj)
            return found

        return index.update(put)

    def drop(self, keys: Iterable[ObjectKey], *, when: DropFilter | None = None, tombstone: bool = False) -> int:
        """Delete index entries (the bytes stay until their segment is reclaimed); returns how many were deleted.

        `when`, if given, is asked inside the write transaction about each indexed key's current entry (None: its
        value is corrupt); only keys it accepts are dropped, so a cleaner's decision cannot hit a record that changed.
        On the applier's thread the keys go in pieces, each its own transaction (`kvtier.store.gil.Piece`).
        """
        index = self._ctx.index
        pairs = [(k, encode_key(k)) for k in keys]
        stamp = pack_time(time.time())
        served: list[ObjectKey] = []  # dropped keys that were in service (a quarantined one was out already)

        def put(txn: lmdb.Transaction, start: int) -> tuple[int, int]:
            served.clear()  # (run again after the map grew)
            ledger = Ledger(index, txn)
            piece = Piece(index.writers)
            n, i = 0, start
            while i < len(pairs) and not piece.over():
                key, raw_key = pairs[i]
                i += 1
                raw = txn.get(raw_key, db=index.obj)
                if raw is None:
                    continue
                entry = entry_or_none(raw)
                if when is not None and not when(key, entry):
                    continue
                ledger.forget(raw_key, raw)
                txn.delete(raw_key, db=index.obj)
                txn.delete(raw_key, db=index.atime)
                if tombstone:
                    txn.put(raw_key, stamp, db=index.gone)
                if entry is not None and entry.state is RecordState.LIVE:
                    served.append(key)
                n += 1
            ledger.save()
            return n, i

        def piece(start: int) -> tuple[int, int]:
            index.writers.before_write()  # not under the observe lock, which a durable batch's commit takes too
            with self._ctx.observing() as tell:
                done = index.update(functools.partial(put, start=start), hold_back=False)
                tell("removed", served)
            return done

        return sum(in_pieces(piece, len(pairs)))

    def drop_if(self, items: Sequence[DropIf], *, tombstone: bool = False) -> int:
        """Decide to drop records that are still what the caller saw (see `DropIf`); returns how many went."""
        return int(self._ctx.decide(Drop(list(items), tombstone)))

    def apply_drop(self, d: Drop) -> int:
        conds = {bytes(i.key): i for i in d.items}
        now = time.time()

        def when(key: ObjectKey, e: IndexEntry | None) -> bool:
            c = conds[encode_key(key)]
            if c.seq >= 0 and (e is None or e.seq != c.seq):
                return False
            if c.state >= 0 and (e is None or int(e.state) != c.state):
                return False
            return c.pinned_ok or (e is not None and e.pin_until <= now)

        return self.drop([decode_key(k) for k in conds], when=when, tombstone=d.tombstone)

    def prune_tombstones(self, older_than: float, *, start: bytes = b"", scan: int = 4096) -> tuple[int, bytes]:
        """Forget eviction tombstones written before `older_than` (unix time; a corrupt one goes too): those
        keys read as missing again. Looks at most `scan` tombstones from key `start`, in a read transaction of
        the calling process (the verifier's: the daemon's applier does not walk the tombstones, it only deletes
        the ones it is sent, each checked again); a pass that finds none expired decides nothing. Returns (how
        many went, the key to resume from: b"" once the end was reached)."""
        index = self._ctx.index
        found: list[bytes] = []
        resume = b""
        with index.read() as txn, txn.cursor(db=index.gone) as cur:
            more = cur.set_range(start) if start else cur.first()
            for _ in range(scan):
                if not more:
                    break
                if _expired(cur.value(), older_than):
                    found.append(bytes(cur.key()))
                more = cur.next()
            if more:
                resume = bytes(cur.key())
        if not found:
            return 0, resume
        return int(self._ctx.decide(PruneTombstones(older_than, found))), resume

    def apply_prune(self, d: PruneTombstones) -> int:
        """Delete the named tombstones still written before `d.older_than` (not evicted again since the
        sender's scan), in pieces (`kvtier.store.gil.Piece`)."""
        index = self._ctx.index
        found = [bytes(k) for k in d.keys]

        def delete(txn: lmdb.Transaction, start: int) -> tuple[int, int]:
            piece = Piece(index.writers)
            n, i = 0, start
            while i < len(found) and not piece.over():
                raw_key = found[i]
                i += 1
                value = txn.get(raw_key, db=index.gone)
                if value is not None and _expired(value, d.older_than):
                    txn.delete(raw_key, db=index.gone)
                    n += 1
            return n, i

        return sum(in_pieces(lambda at: index.update(functools.partial(delete, start=at)), len(found)))

    # ----------------------------------------------------------------- quarantine and verification

    def quarantine(self, key: ObjectKey, reason: QuarantineReason) -> bool:
        """Take a record out of service with reason and time (readers get a miss); False if it is not indexed."""
        return bool(self._ctx.decide(Quarantine(encode_key(key), int(reason))))

    def apply_quarantine(self, d: Quarantine) -> bool:
        index = self._ctx.index
        raw_key = bytes(d.key)
        key = decode_key(raw_key)
        reason = QuarantineReason(d.reason)
        now = time.time()

        was_live: list[bool] = [False]

        def put(txn: lmdb.Transaction) -> bool:
            raw = txn.get(raw_key, db=index.obj)
            if raw is None:
                return False
            entry = entry_or_none(raw)
            was_live[0] = entry is not None and entry.state is RecordState.LIVE
            if entry is None:  # location unknown: keep a tombstone so the key reads as corrupt
                entry = IndexEntry(
                    RecordState.QUARANTINED, key.form, Codec.NONE, 0, 0, 0, 0, 0, bytes(16), bytes(16), 0, now
                )
            quarantined = dataclasses.replace(
                entry, state=RecordState.QUARANTINED, quarantine_reason=int(reason), quarantined_at=now
            )
            txn.put(raw_key, quarantined.pack(), db=index.obj)
            return True

        index.writers.before_write()  # not under the observe lock (see drop)
        with self._ctx.observing() as tell:
            done = index.update(put, hold_back=False)
            tell("removed", [key] if done and was_live[0] else [])
        return done

    def quarantine_faults(self, faults: Iterable[tuple[ObjectKey, QuarantineReason]]) -> None:
        """Quarantine what a read or a check found, one short transaction each."""
        for key, why in faults:
            log.warning("quarantining %s: %s", key_str(key), why.label)
            self.quarantine(key, why)

    def verify_many(self, keys: Sequence[ObjectKey], *, apply: bool = True) -> list[VerifyResult]:
        """Read and check records in one short read transaction (bound the batch); with `apply`, quarantine the
        failures and stamp verified_at (clearing dirty) on the good ones in one write transaction."""
        index = self._ctx.index
        failures: list[tuple[ObjectKey, QuarantineReason]] = []
        slots: list[VerifyResult] = []
        items: list[ScanItem] = []
        at: list[int] = []  # each item's place in `slots`
        raws: list[bytes] = []
        with index.read() as txn:
            for i, key in enumerate(keys):
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=index.obj)
                entry = entry_or_none(raw) if raw is not None else None
                if raw is None:
                    slots.append(VerifyResult(Reason.MISSING))
                elif entry is None:
                    failures.append((key, QuarantineReason.INDEX_VALUE))
                    slots.append(VerifyResult(Reason.CORRUPT, QuarantineReason.INDEX_VALUE))
                elif entry.state is RecordState.QUARANTINED:
                    slots.append(VerifyResult(QuarantineReason(entry.quarantine_reason).miss_reason))
                else:
                    slots.append(VerifyResult(Reason.OK))
                    items.append(ScanItem(key, entry, raw_key))
                    at.append(i)
                    raws.append(bytes(raw))
            bad = self._reader.scan(txn, items, _nothing)  # runs of records, checked in the bounce buffer
        for k, exc in bad:
            failures.append((items[k].key, exc.reason))
            slots[at[k]] = VerifyResult(exc.reason.miss_reason, exc.reason)
        failed = {k for k, _ in bad}
        good = [(it.raw_key, raws[k]) for k, it in enumerate(items) if k not in failed]
        if not apply:
            return slots
        self.quarantine_faults(failures)
        if good:
            self._ctx.decide(Stamp(good, time.time()))
        return slots

    def apply_stamp(self, d: Stamp) -> None:
        """Stamp verified_at and clear the dirty row of each record whose value is unchanged since its check (in
        pieces on the applier's thread: `kvtier.store.gil.Piece`)."""
        index = self._ctx.index
        rows = d.rows

        def stamp(txn: lmdb.Transaction, start: int) -> tuple[None, int]:
            piece = Piece(index.writers)
            i = start
            while i < len(rows) and not piece.over():
                raw_key, raw = rows[i]
                i += 1
                cur = txn.get(raw_key, db=index.obj)
                if cur is not None and bytes(cur) == raw:  # unchanged since the read
                    entry = IndexEntry.unpack(raw)
                    txn.put(raw_key, dataclasses.replace(entry, verified_at=d.at).pack(), db=index.obj)
                    txn.delete(u64_key(entry.seq), db=index.dirty)
            return None, i

        in_pieces(lambda at: index.update(functools.partial(stamp, start=at)), len(rows))

    # ----------------------------------------------------------------- scans

    def records(self, keys: Sequence[ObjectKey]) -> list[RecordInfo | None]:
        """The index rows of `keys` (None where a key is not indexed), in one short read transaction."""
        index = self._ctx.index
        with index.read() as txn:
            atimes = txn.cursor(db=index.atime)
            out: list[RecordInfo | None] = []
            for key in keys:
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=index.obj)
                info = None if raw is None else RecordInfo(key, entry_or_none(raw), atime_or_zero(atimes.get(raw_key)))
                out.append(info)
            return out

    def index_page(self, after: bytes | None, limit: int) -> IndexPage:
        """Up to `limit` index rows in key order after the encoded key `after` (from the first with None), as columns
        (`index_page.IndexPage`), in one short read transaction."""
        index = self._ctx.index
        with index.read() as txn:
            cur = txn.cursor(db=index.obj)
            if not cur.set_range(after or b""):
                return IndexPage.parse([], [], [])
            if after is not None and cur.key() == after and not cur.next():
                return IndexPage.parse([], [], [])
            return _page(index, txn, list(itertools.islice(cast("Iterator[tuple[bytes, bytes]]", cur), limit)))

    def records_page(self, keys: Sequence[ObjectKey]) -> IndexPage:
        """The index rows of those of `keys` that are indexed, in their order, as columns (one short read txn)."""
        index = self._ctx.index
        with index.read() as txn:
            found = txn.cursor(db=index.obj).getmulti([encode_key(k) for k in keys])
            return _page(index, txn, cast("list[tuple[bytes, bytes]]", found))

    def iter_records(
        self, after: ObjectKey | None = None, limit: int = 256, namespace: bytes | None = None
    ) -> list[RecordInfo]:
        """Up to `limit` records in key order after `after` (one short read txn per call)."""
        index = self._ctx.index
        start = encode_key(after) if after is not None else (namespace or b"")
        out: list[RecordInfo] = []
        with index.read() as txn:
            cur = txn.cursor(db=index.obj)
            atimes = txn.cursor(db=index.atime)
            if not cur.set_range(start):
                return out
            if after is not None and cur.key() == start and not cur.next():
                return out
            for raw_key, raw in cast("Iterator[tuple[bytes, bytes]]", cur):  # buffers=False: bytes
                if namespace is not None and not raw_key.startswith(namespace):
                    break
                key = decode_key(bytes(raw_key))
                out.append(RecordInfo(key, entry_or_none(raw), atime_or_zero(atimes.get(raw_key))))
                if len(out) >= limit:
                    break
        return out

    def iter_dirty(self, after_seq: int = 0, limit: int = 256) -> list[tuple[int, ObjectKey]]:
        """Records written (and not verified) since the last verification, oldest first: (seq, key)."""
        out: list[tuple[int, ObjectKey]] = []
        with self._ctx.index.read() as txn:
            cur = txn.cursor(db=self._ctx.index.dirty)
            if not cur.set_range(u64_key(after_seq + 1)):
                return out
            for raw_seq, raw_key in cur:
                out.append((int.from_bytes(raw_seq, "big"), decode_key(bytes(raw_key))))
                if len(out) >= limit:
                    break
        return out


def _nothing(number: int, header: object, mv: memoryview, at: int) -> None:
    """A verify's visit: the scan's checks are the verdict; the bytes go nowhere."""


def _expired(value: bytes | memoryview, older_than: float) -> bool:
    """Whether a tombstone was written before `older_than`; a corrupt one counts as expired."""
    try:
        return unpack_time(value) < older_than
    except CorruptRecord:
        return True


def _page(index: Index, txn: lmdb.Transaction, rows: list[tuple[bytes, bytes]]) -> IndexPage:
    """`rows` ((key, value) pairs of the `obj` table, buffers=False: bytes) with their access times, as columns."""
    keys = [k for k, _ in rows]
    atimes = dict(cast("list[tuple[bytes, bytes]]", txn.cursor(db=index.atime).getmulti(keys)))
    return IndexPage.parse(keys, [v for _, v in rows], [atimes.get(k) for k in keys])
