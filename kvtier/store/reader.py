"""The read side: index lookups, segment files, and loads and scans through the one read path, the batch pipeline
(`packed.PackedLoad`, `scan.PackedScan`); a request it does not read is answered from the index alone (`_name`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterator, Sequence

import lmdb

from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest, MoreRequests, ObjectKey
from kvtier.store.context import StoreContext, flat_uint8
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.index import IndexEntry, NamespaceEntry, RecordState, encode_key
from kvtier.store.index_map import map_in
from kvtier.store.io import SegmentFile
from kvtier.store.packed import PackedLoad, take_buffers
from kvtier.store.scan import PackedScan, ScanItem, ScanVisit
from kvtier.store.segments import segment_name
from kvtier.store.submit import Reads, close_reads, open_reads

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class LoadOutcome:
    """What one `load` found: an answer per request, the faults to quarantine, the keys it served."""

    reasons: list[Reason]
    faults: list[tuple[ObjectKey, QuarantineReason]]
    hits: list[bytes]  # encoded keys


class Reader:
    """Looks records up and reads them; keeps each segment file open once opened (until it is unlinked)."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self._files: dict[int, SegmentFile] = {}
        self._files_lock = threading.Lock()
        self._ns_reasons: dict[bytes, tuple[bytes, Reason]] = {}  # namespace -> (index value, the reason it gives)
        # The read threads start with the store, not inside its first load: on a busy host eight thread starts
        # cost milliseconds, as much as a thousand small records take to read.
        ctx.executor("read")

    def take_load_resources(self) -> None:
        """Fault in the packed path's bounce buffers now (`packed.take_buffers`), map the index's pages in
        (`index_map.map_in`) and, where loads read through native AIO, set up a context: a daemon's first restore
        otherwise pays all three."""
        close_reads(open_reads(self._ctx))
        take_buffers(self._ctx)
        map_in(self._ctx.index)

    # ----------------------------------------------------------------- lookups

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> tuple[list[Reason], list[ObjectKey]]:
        """Index-only check per key, and the keys whose index value is corrupt."""
        corrupt: list[ObjectKey] = []
        with self._ctx.index.read() as txn:
            out = [r for r, _ in self.lookups(txn, keys, [encode_key(k) for k in keys], layout_digests, corrupt)]
        return out, corrupt

    def lookups(
        self,
        txn: lmdb.Transaction,
        keys: Sequence[ObjectKey],
        raw_keys: Sequence[bytes],
        digests: Sequence[bytes],
        corrupt: list[ObjectKey],
    ) -> Iterator[tuple[Reason, IndexEntry | None]]:
        """Per key, its index entry if a load should read its record, else why not (keys whose index value is
        corrupt are added to `corrupt`). A generator: one frame for the batch, not a call per object; each
        namespace is looked up once per batch."""
        index = self._ctx.index
        get, obj, gone, unpack = txn.get, index.obj, index.gone, IndexEntry.unpack
        ns_reasons: dict[bytes, Reason] = {}
        for key, raw_key, digest in zip(keys, raw_keys, digests):
            ns_reason = ns_reasons.get(key.namespace)
            if ns_reason is None:
                ns_reason = ns_reasons[key.namespace] = self._namespace_reason(txn, key.namespace)
            if ns_reason is not _OK:
                yield ns_reason, None
                continue
            raw = get(raw_key, db=obj)
            if raw is None:
                yield (
                    (Reason.EVICTED if gone is not None and get(raw_key, db=gone) is not None else Reason.MISSING),
                    None,
                )
                continue
            try:
                entry = unpack(raw)
            except CorruptRecord:
                corrupt.append(key)
                yield Reason.CORRUPT, None
                continue
            if entry.state is _QUARANTINED:
                yield QuarantineReason(entry.quarantine_reason).miss_reason, None
            elif entry.layout_digest != digest:
                yield Reason.ABI_MISMATCH, None
            else:
                yield _OK, entry

    def _namespace_reason(self, txn: lmdb.Transaction, namespace: bytes) -> Reason:
        """OK while the namespace is registered and live, else the miss every key of it gets. Its index value is
        read in `txn` every time; one seen before gives the reason it gave then, its bytes compared and not decoded
        again (every load asks this, and decoding the entry cost more CPU than a small load's lookups)."""
        raw = txn.get(namespace, db=self._ctx.index.ns)
        if raw is None:
            return Reason.MISSING
        value = bytes(raw)
        seen = self._ns_reasons.get(namespace)
        if seen is not None and seen[0] == value:
            return seen[1]
        try:
            live = NamespaceEntry.unpack(value).live
        except CorruptRecord:
            log.error(
                "namespace entry %s is corrupt: its records are misses until it is re-registered", namespace.hex()
            )
            return Reason.MISSING
        if len(self._ns_reasons) >= _NS_SEEN:  # (namespaces come and go with rollouts: the map stays small)
            self._ns_reasons.clear()
        reason = _OK if live else Reason.STALE_VERSION
        self._ns_reasons[namespace] = (value, reason)
        return reason

    # ----------------------------------------------------------------- loads

    def load(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> LoadOutcome:
        """Read, verify and copy each record into its `out`, in as few large reads as the layout allows; `more`
        as `LowerTier.load_into` has it (its requests are answered after `requests`).

        The read transaction stays open across the batch's reads: LMDB's reader table is the epoch
        that keeps the cleaner from unlinking a segment this batch could still read (FORMAT.md).
        """
        outcome = LoadOutcome([], [], [])
        with self._ctx.index.read() as txn:
            self._load_packed(txn, open_reads(self._ctx), requests, more, outcome)
        return outcome

    def _load_packed(
        self,
        txn: lmdb.Transaction,
        reads: Reads,
        requests: Sequence[LoadRequest],
        more: MoreRequests | None,
        outcome: LoadOutcome,
    ) -> None:
        """What `PackedLoad` reads and checks through `reads` (and the faults it names), then why the rest have
        nothing to read (`_name`), each answer in its request's place."""
        packed = PackedLoad(self._ctx, txn, reads, self.segment, self._namespace_reason)
        n = len(requests)
        extra: Sequence[LoadRequest] = ()
        try:
            rest = packed.add(requests, 0)
            if more is not None:  # (once the first requests' reads are out)
                extra = more()
                rest += packed.add(extra, n)
            outcome.hits, faults = packed.finish()
        finally:
            packed.close()
            close_reads(reads)
        outcome.reasons = [_OK] * (n + len(extra))

        def request(i: int) -> LoadRequest:  # (indexed, not listed: a LoadBatch builds a request only when asked)
            return requests[i] if i < n else extra[i - n]

        for i, exc in faults:
            outcome.reasons[i] = exc.reason.miss_reason
            outcome.faults.append((request(i).key, exc.reason))
        if rest:
            rest.sort()
            for i, reason in zip(rest, self._name(txn, [request(i) for i in rest], outcome)):
                outcome.reasons[i] = reason

    def _name(self, txn: lmdb.Transaction, requests: Sequence[LoadRequest], outcome: LoadOutcome) -> list[Reason]:
        """Why each request the pipeline did not take has nothing to read, from the index alone: no record, evicted,
        quarantined, another layout or length, a retired namespace, a corrupt index value (a fault: `index_value`).
        An entry the pipeline would read but for its lengths, stored as is with a stored length other than its
        payload's, is an index value no writer makes: a fault (`index_value`), never a read."""
        corrupt: list[ObjectKey] = []
        keys = [req.key for req in requests]
        digests = [req.layout_digest for req in requests]
        reasons: list[Reason] = []
        for req, (reason, entry) in zip(
            requests, self.lookups(txn, keys, [encode_key(k) for k in keys], digests, corrupt)
        ):
            if entry is not None:
                if entry.payload_len != flat_uint8(req.out).numel():
                    reason = Reason.ABI_MISMATCH
                else:
                    corrupt.append(req.key)
                    reason = QuarantineReason.INDEX_VALUE.miss_reason
            reasons.append(reason)
        outcome.faults += [(key, QuarantineReason.INDEX_VALUE) for key in corrupt]
        return reasons

    def scan(
        self, txn: lmdb.Transaction, items: Sequence[ScanItem], visit: ScanVisit, *, headers: bool = False
    ) -> list[tuple[int, CorruptRecord]]:
        """Read and check `items`' records with no target through the batch pipeline (`scan.PackedScan` states the
        contract): `visit` gets each good one while its bytes are in the bounce buffer; returns the bad ones, by
        their number in `items`, each with its quarantine reason. `txn` is the caller's read transaction, in which
        it looked the records up: it keeps their segments from being unlinked while they are read."""
        reads = open_reads(self._ctx)
        scan = PackedScan(self._ctx, txn, reads, self.segment, self._namespace_reason)
        try:
            scan.add_items(items, visit, headers)
            return scan.finish_scan()
        finally:
            scan.close()
            close_reads(reads)

    # ----------------------------------------------------------------- segment files

    def segment(self, seg_id: int) -> SegmentFile:
        with self._files_lock:
            seg = self._files.get(seg_id)
            if seg is None:
                try:
                    seg = self._ctx.backend.open(os.path.join(self._ctx.seg_dir, segment_name(seg_id)))
                except FileNotFoundError:
                    raise CorruptRecord(QuarantineReason.SEGMENT_MISSING, f"segment {seg_id:016x} is gone") from None
                self._files[seg_id] = seg
            return seg

    def close_unlinked(self) -> None:
        """Close cached segment files the cleaner unlinked (their space is freed only once closed)."""
        with self._files_lock:
            for seg_id in [s for s, f in self._files.items() if f.unlinked()]:
                self._files.pop(seg_id).close()

    def close(self) -> None:
        with self._files_lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


_OK = Reason.OK
_NS_SEEN = 1024  # namespaces whose last seen index value and reason a store keeps
_QUARANTINED = RecordState.QUARANTINED
