"""DiskStore: the on-disk prefix store, a LowerTier keyed by (namespace, block hash, group, form).

A facade: the work is done by the reader (lookups and checked reads), the writer (admission, batches, commit,
budgets), maintenance and compaction (the verifier and cleaner's primitives) and the catalog (namespaces,
published limits, shared documents, stats), which share one StoreContext.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.store_config import StoreConfig, StoreLimits
from kvtier.core.tier import KeyPage, LoadRequest, MoreRequests, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.store import ns_usage
from kvtier.store.atimes import AccessTimes
from kvtier.store.catalog import Catalog
from kvtier.store.channel import DecisionClient
from kvtier.store.compaction import Compaction
from kvtier.store.context import StoreContext, StoreObserver, flat_uint8, key_str
from kvtier.store.decisions import (
    AllocateSegment,
    Decision,
    Drop,
    DropIf,
    PruneTombstones,
    PutDoc,
    Quarantine,
    Repoint,
    SealAbandoned,
    SealSegment,
    Stamp,
    UnlinkSegment,
)
from kvtier.store.errors import QuarantineReason, StoreReadOnly, StoreRequestError
from kvtier.store.index import Index, NamespaceEntry, SegmentEntry
from kvtier.store.index_page import IndexPage
from kvtier.store.io import PosixBackend, select_backend
from kvtier.store.keyscan import live_keys
from kvtier.store.maintenance import DropFilter, Maintenance, RecordInfo, VerifyResult
from kvtier.store.reader import Reader
from kvtier.store.segments import SEGMENTS_DIR, WriterLock
from kvtier.store.writer import Writer

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch


class DiskStore:
    """The disk tier. Open one per process (after any fork); `writer=True` only in the daemon.

    `decisions`: a maintenance process beside a daemon (the verifier) passes the channel to it. Its index is then
    opened read-only (it cannot take LMDB's write lock at all), and every index change it decides is sent to the
    daemon, which applies it (`kvtier.store.decisions`). Without one, its changes are applied here.

    A store that may load (not `readonly`) sets up its loads' AIO context and bounce buffers (torch tensors) and maps
    its index's pages in when it opens, so its first load does not pay them (faulting in the buffers costs about as
    much as a small load's reads, the index pages a fault every few records of a random small load):
    an engine's reader serves restores as a daemon's writer does. `take_load_resources=False` leaves them to a later
    `take_load_resources()`: a daemon opens its store and serves lookups before torch is loaded."""

    def __init__(
        self,
        root: str,
        config: StoreConfig | None = None,
        *,
        writer: bool = False,
        readonly: bool = False,
        decisions: DecisionClient | None = None,
        take_load_resources: bool = True,
    ) -> None:
        config = config or StoreConfig()
        if writer and readonly:
            raise ValueError("a store cannot be both writer and read-only")
        if decisions is not None and (writer or readonly):
            raise ValueError("only a maintenance store (neither writer nor read-only) sends decisions to a daemon")
        self.root = os.path.abspath(root)
        self.readonly = readonly
        seg_dir = os.path.join(self.root, SEGMENTS_DIR)
        if not readonly:
            os.makedirs(seg_dir, exist_ok=True)
        self._writer_lock = WriterLock(self.root) if writer else None
        try:
            self.index = Index(self.root, readonly=readonly or decisions is not None)
            self.backend: PosixBackend = select_backend(seg_dir, config.io_backend, readonly=readonly)
        except BaseException:
            if getattr(self, "index", None) is not None:
                self.index.close()
            if self._writer_lock:
                self._writer_lock.release()
            raise
        self._ctx = StoreContext(self.root, seg_dir, config, self.index, self.backend, readonly=readonly)
        self._write_lock: threading.Lock = self._ctx.write_lock
        self.decisions = decisions
        self._ctx.decide = decisions.send if decisions is not None else self.apply_decision
        self._reader = Reader(self._ctx)
        self._atimes = AccessTimes(self._ctx)
        self._maintenance = Maintenance(self._ctx, self._reader)
        self._compaction = Compaction(self._ctx, self._reader, self._maintenance)
        self._catalog = Catalog(self._ctx)
        self._writer: Writer | None = None
        if writer:
            self._writer = Writer(self._ctx)
            ns_usage.repair(self.index)  # a store written before the namespace rows, or by a kvtier without them
            self.seal_abandoned_segments()
            self._catalog.publish_limits()
        if take_load_resources and not readonly:
            self.take_load_resources()
        if not readonly and decisions is None:
            self._atimes.start()  # last: a store that failed to open leaves no thread behind

    def take_load_resources(self) -> None:
        """Set up what loads read through now (an AIO context, bounce buffers), not inside the first restore."""
        self._reader.take_load_resources()

    # ----------------------------------------------------------------- properties

    @property
    def config(self) -> StoreConfig:
        return self._ctx.config

    @property
    def io_backend(self) -> str:
        """'gds', 'odirect' or 'buffered' (the last only where the filesystem refuses O_DIRECT)."""
        return self.backend.name

    @property
    def is_writer(self) -> bool:
        return self._writer is not None

    @property
    def segment_dir(self) -> str:
        """Where the segment files are (named by `segment_name`)."""
        return self._ctx.seg_dir

    # ----------------------------------------------------------------- namespaces

    def register_namespace(
        self,
        version_key: VersionKey,
        *,
        live: bool = True,
        codecs: Mapping[CacheForm, str] | None = None,
        identity: Mapping[str, Any] | None = None,
    ) -> bytes:
        """Register (or update) a namespace with its full version key; codecs per form default to none.

        `identity`: the document an engine tier derived the key's `engine_config` digest from (kept for audits)."""
        self._check_pid()
        return self._catalog.register_namespace(version_key, live=live, codecs=codecs, identity=identity)

    def retire_namespace(self, namespace: bytes) -> bool:
        """Mark a namespace retired: its records become misses (stale_version) at once; returns if it existed."""
        self._check_pid()
        return self._catalog.retire_namespace(namespace)

    def namespaces(self) -> dict[bytes, NamespaceEntry]:
        self._check_pid()
        return self._catalog.namespaces()

    # ----------------------------------------------------------------- LowerTier: lookups and loads

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        """Index-only check per key: OK if a load would be attempted, else why not."""
        self._check_pid()
        if len(keys) != len(layout_digests):
            raise StoreRequestError("has(): keys and layout_digests differ in length: pass one digest per key")
        reasons, corrupt = self._reader.has(keys, layout_digests)
        self._maintenance.quarantine_faults((key, QuarantineReason.INDEX_VALUE) for key in corrupt)
        return reasons

    def live_keys(self, namespace: bytes, after: bytes = b"", limit: int = 4096) -> KeyPage:
        """A page of the namespace's live keys from the index keys alone (see `kvtier.store.keyscan`)."""
        self._check_pid()
        return live_keys(self.index, namespace, after, limit)

    def load_into(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> list[Reason]:
        """Read, verify and copy each record into its `out`; a record that fails a check is quarantined. `more`'s
        requests (`LowerTier.load_into`) are looked up once the reads of `requests` are on their way."""
        self._check_pid()
        outcome = self._reader.load(requests, more)
        self._maintenance.quarantine_faults(outcome.faults)
        if not self.readonly and self.decisions is None:
            self._atimes.touch(outcome.hits)
        return outcome.reasons

    # ----------------------------------------------------------------- LowerTier: writes

    def store(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes) -> None:
        """Persist one sealed object; durable (fdatasync + LMDB commit) when it returns."""
        self.store_many([(key, payload, layout_digest)])

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        """Persist objects with one fdatasync per segment and one commit: all visible, or none (StoreFull)."""
        self._check_pid()
        if self._writer is None:
            raise StoreReadOnly("this store was opened without the writer role: only the kvtier daemon stores objects")
        for key, payload, digest in items:
            flat_uint8(payload)
            if len(digest) != 16:
                raise StoreRequestError(f"layout digest for {key_str(key)} must be 16 bytes")
        self._writer.store_many(items)

    def durable_first(self) -> contextlib.AbstractContextManager[None]:
        """Around the time an engine waits for its objects to be made durable (a durable offload): this process's
        applier of the verifier's decisions holds back its next write transaction until the block ends (at most
        `gil.HOLD_BACK_S`), as it does for each durable batch (`gil.DurableFirst`)."""
        return self.index.writers.durable()

    # ----------------------------------------------------------------- LowerTier: pins and removal

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> int:
        """Protect records from eviction until now + ttl_s (extends, never shortens); returns how many exist."""
        self._check_pid()
        return self._maintenance.pin(keys, ttl_s)

    def remove(self, keys: Sequence[ObjectKey]) -> int:
        return self.drop(keys)

    def evict(self, keys: Iterable[ObjectKey], *, when: DropFilter | None = None) -> int:
        """`drop` to make room, leaving a tombstone per key (`gone`): until it is stored again or the cleaner
        prunes the tombstone, lookups and loads answer `evicted` rather than `missing`."""
        return self.drop(keys, when=when, tombstone=True)

    def drop(self, keys: Iterable[ObjectKey], *, when: DropFilter | None = None, tombstone: bool = False) -> int:
        """Delete index entries (the bytes stay until their segment is reclaimed); returns how many were deleted.

        `when`, if given, is asked inside the write transaction about each indexed key's current entry (None: its
        value is corrupt); only keys it accepts are dropped, so a cleaner's decision cannot hit a record that changed.
        """
        self._check_pid()
        return self._maintenance.drop(keys, when=when, tombstone=tombstone)

    def drop_if(self, items: Sequence[DropIf], *, tombstone: bool = False) -> int:
        """Drop the records that are still what the caller saw (`DropIf`: sequence, state, pins); `tombstone`:
        an eviction. The cleaner's form of `drop` / `evict`: a record, it can be sent to the daemon."""
        self._check_pid()
        return self._maintenance.drop_if(items, tombstone=tombstone)

    # ----------------------------------------------------------------- verifier / cleaner primitives

    def prune_tombstones(self, older_than: float, *, start: bytes = b"", scan: int = 4096) -> tuple[int, bytes]:
        """Forget eviction tombstones older than `older_than` (see `Maintenance.prune_tombstones`)."""
        self._check_pid()
        return self._maintenance.prune_tombstones(older_than, start=start, scan=scan)

    def quarantine(self, key: ObjectKey, reason: QuarantineReason) -> bool:
        """Take a record out of service with reason and time (readers get a miss); False if it is not indexed."""
        self._check_pid()
        return self._maintenance.quarantine(key, reason)

    def verify(self, key: ObjectKey) -> Reason:
        """Read and check one record without loading it anywhere; quarantines on failure, stamps verified_at."""
        return self.verify_many([key])[0].reason

    def verify_many(self, keys: Sequence[ObjectKey], *, apply: bool = True) -> list[VerifyResult]:
        """Read and check records in one short read transaction (bound the batch); with `apply`, quarantine the
        failures and stamp verified_at (clearing dirty) on the good ones in one write transaction."""
        self._check_pid()
        return self._maintenance.verify_many(keys, apply=apply)

    def records(self, keys: Sequence[ObjectKey]) -> list[RecordInfo | None]:
        """The index rows of `keys` (None where a key is not indexed), in one short read transaction."""
        self._check_pid()
        return self._maintenance.records(keys)

    def iter_records(
        self, after: ObjectKey | None = None, limit: int = 256, namespace: bytes | None = None
    ) -> list[RecordInfo]:
        """Up to `limit` records in key order after `after` (one short read txn per call)."""
        self._check_pid()
        return self._maintenance.iter_records(after, limit, namespace)

    def index_page(self, after: bytes | None = None, limit: int = 1024) -> IndexPage:
        """Up to `limit` index rows after the encoded key `after`, as columns (`index_page.IndexPage`): a walk over
        every record without a Python object per row (one short read txn per call)."""
        self._check_pid()
        return self._maintenance.index_page(after, limit)

    def records_page(self, keys: Sequence[ObjectKey]) -> IndexPage:
        """The index rows of those of `keys` that are indexed, in their order, as columns (one short read txn)."""
        self._check_pid()
        return self._maintenance.records_page(keys)

    def iter_dirty(self, after_seq: int = 0, limit: int = 256) -> list[tuple[int, ObjectKey]]:
        """Records written (and not verified) since the last verification, oldest first: (seq, key)."""
        self._check_pid()
        return self._maintenance.iter_dirty(after_seq, limit)

    def segments(self) -> dict[int, SegmentEntry]:
        self._check_pid()
        return self._compaction.segments()

    def seal_abandoned_segments(self) -> int:
        """Seal unsealed segments whose appender is gone (its flock is free); returns how many. They are found here
        (the segment table read, the files probed) and a decision is sent only for those found: beside a daemon,
        a maintenance pass with none found costs the daemon nothing."""
        self._check_pid()
        found = self._compaction.abandoned_segments(self._owned_segment())
        return int(self._ctx.decide(SealAbandoned(found))) if found else 0

    def _owned_segment(self) -> int:
        """The segment this process's writer appends to (0: none), which is never abandoned."""
        return self._writer.appender.owned_segment if self._writer else 0

    def try_unlink_segment(self, seg_id: int) -> bool:
        """Unlink a sealed segment that no record references, once no reader can still see a dropped record in it."""
        self._check_pid()
        return bool(self._ctx.decide(UnlinkSegment(seg_id)))

    def trim_segment(self, seg_id: int) -> int:
        """Cut a sealed segment's uncommitted tail (bytes a crashed batch left past `tail`); returns bytes freed."""
        self._check_pid()
        return self._compaction.trim_segment(seg_id)

    def relocate(self, batches: Iterable[Sequence[ObjectKey]]) -> list[int]:
        """Copy live records into a segment of this process's and repoint them, per batch of keys, under one sync
        and one commit, cut in pieces on the daemon's applier thread (see `Compaction.relocate`)."""
        self._check_pid()
        return self._compaction.relocate(batches)

    def close_unlinked(self) -> None:
        """Close cached segment files that were unlinked."""
        self._check_pid()
        self._reader.close_unlinked()

    def reader_check(self) -> int:
        """Clear dead readers from LMDB's table (not in the daemon: `Index.reader_check` says why); close cached
        segment files that were unlinked."""
        self.close_unlinked()
        return self.index.reader_check()

    def apply_decision(self, decision: Decision) -> object:
        """Apply one maintenance decision to the index in this process, in its own short write transaction(s):
        the daemon does so for the verifier's (`kvtier.store.channel.DecisionServer`), a store with no daemon
        for its own."""
        self._check_pid()
        if self.index.readonly:
            raise StoreReadOnly("this store's index is read-only here: its decisions go to the daemon")
        m, c = self._maintenance, self._compaction
        match decision:
            case Drop():
                return m.apply_drop(decision)
            case Quarantine():
                return m.apply_quarantine(decision)
            case PruneTombstones():
                return m.apply_prune(decision)
            case Stamp():
                m.apply_stamp(decision)
                return None
            case PutDoc():
                self._catalog.apply_put_doc(decision)
                return None
            case AllocateSegment():
                return c.apply_allocate()
            case SealSegment():
                c.apply_seal(decision)
                return None
            case SealAbandoned():
                return c.seal_abandoned(decision.seg_ids, self._owned_segment())
            case Repoint():
                return c.apply_repoint(decision)
            case UnlinkSegment():
                return c.try_unlink_segment(decision.seg_id)
        raise StoreRequestError(f"unknown maintenance decision {type(decision).__name__}")

    def observe(self, observer: StoreObserver | None) -> None:
        """Tell `observer` ("stored" | "removed", keys) of every index commit that changes which keys this store
        serves, in commit order: writes, drops and evictions (the verifier's too, applied here), quarantines."""
        self._ctx.observer = observer

    # ----------------------------------------------------------------- limits, documents, stats

    def set_limits(self, budget_bytes: int, form_quotas: Mapping[CacheForm, int]) -> None:
        """Change the byte budget and per-form quotas (a reload) and publish them for the cleaner and `kvtier audit`."""
        self._check_pid()
        self._catalog.set_limits(budget_bytes, form_quotas)

    def limits(self) -> StoreLimits | None:
        """The limits the writer last published (None if no writer has yet)."""
        self._check_pid()
        return self._catalog.limits()

    def format_version(self) -> int:
        """The on-disk format version recorded in the index (FORMAT.md)."""
        self._check_pid()
        return self.index.format_version()

    def meta_doc(self, name: str) -> dict[str, Any] | None:
        """A JSON document another process keeps in the index (`verifier`: the cleaner's progress and counters)."""
        self._check_pid()
        return self._catalog.meta_doc(name)

    def put_meta_doc(self, name: str, doc: Mapping[str, Any]) -> None:
        self._check_pid()
        self._catalog.put_meta_doc(name, doc)

    def stats(self) -> dict[str, Any]:
        """Records and bytes per form, achieved codec ratio, budget, segments, namespaces, backend."""
        self._check_pid()
        return self._catalog.stats(self.io_backend)

    # ----------------------------------------------------------------- housekeeping

    def flush_atimes(self) -> None:
        self._atimes.flush()

    def _check_pid(self) -> None:
        self._ctx.check_pid()

    def close(self) -> None:
        """Flush access times, seal the segment being appended, release files, the index and the writer lock."""
        if self._ctx.forked:
            return
        if not self.readonly:
            self._atimes.close()
        self._ctx.close_pools()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._compaction.close()
        self._reader.close()
        self.index.close()
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
