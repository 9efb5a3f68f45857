"""The read side: index lookups, segment files, checked reads of records into tensors, access times."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence

import lmdb
import torch

from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store.context import StoreContext, flat_uint8
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.index import IndexEntry, NamespaceEntry, RecordState, encode_key, pack_time
from kvtier.store.io import AlignedBuffer, SegmentFile
from kvtier.store.record import HEADER_BYTES, Codec, RecordHeader, payload_checksum, zstd_decompress_into
from kvtier.store.segments import segment_name

log = logging.getLogger(__name__)

_ReadJob = tuple[int, ObjectKey, IndexEntry, torch.Tensor]


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

    # ----------------------------------------------------------------- lookups

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> tuple[list[Reason], list[ObjectKey]]:
        """Index-only check per key, and the keys whose index value is corrupt."""
        out: list[Reason] = []
        corrupt: list[ObjectKey] = []
        with self._ctx.index.read() as txn:
            ns_cache: dict[bytes, NamespaceEntry | None] = {}
            for key, digest in zip(keys, layout_digests):
                reason, _ = self.lookup(txn, key, digest, ns_cache, corrupt)
                out.append(reason)
        return out, corrupt

    def lookup(
        self,
        txn: lmdb.Transaction,
        key: ObjectKey,
        digest: bytes,
        ns_cache: dict[bytes, NamespaceEntry | None],
        corrupt: list[ObjectKey],
    ) -> tuple[Reason, IndexEntry | None]:
        index = self._ctx.index
        if key.namespace not in ns_cache:
            try:
                ns_cache[key.namespace] = index.namespace(txn, key.namespace)
            except CorruptRecord:
                log.error(
                    "namespace entry %s is corrupt: its records are misses until it is re-registered",
                    key.namespace.hex(),
                )
                ns_cache[key.namespace] = None
        ns = ns_cache[key.namespace]
        if ns is None:
            return Reason.MISSING, None
        if not ns.live:
            return Reason.STALE_VERSION, None
        raw_key = encode_key(key)
        raw = txn.get(raw_key, db=index.obj)
        if raw is None:
            gone = index.gone
            return (
                Reason.EVICTED if gone is not None and txn.get(raw_key, db=gone) is not None else Reason.MISSING
            ), None
        try:
            entry = IndexEntry.unpack(raw)
        except CorruptRecord:
            corrupt.append(key)
            return Reason.CORRUPT, None
        if entry.state is RecordState.QUARANTINED:
            return QuarantineReason(entry.quarantine_reason).miss_reason, None
        if entry.layout_digest != digest:
            return Reason.ABI_MISMATCH, None
        return Reason.OK, entry

    # ----------------------------------------------------------------- loads

    def load(self, requests: Sequence[LoadRequest]) -> LoadOutcome:
        """Read, verify and copy each record into its `out`; batched over the I/O thread pool.

        The read transaction stays open across the batch's reads: LMDB's reader table is the epoch
        that keeps the cleaner from unlinking a segment this batch could still read (FORMAT.md).
        """
        outcome = LoadOutcome([Reason.MISSING] * len(requests), [], [])
        corrupt_values: list[ObjectKey] = []
        with self._ctx.index.read() as txn:
            ns_cache: dict[bytes, NamespaceEntry | None] = {}
            jobs: list[_ReadJob] = []
            for i, req in enumerate(requests):
                out = flat_uint8(req.out)
                reason, entry = self.lookup(txn, req.key, req.layout_digest, ns_cache, corrupt_values)
                if entry is not None and entry.payload_len != out.numel():
                    reason = Reason.ABI_MISMATCH
                if reason is Reason.OK and entry is not None:
                    jobs.append((i, req.key, entry, out))
                outcome.reasons[i] = reason
            for i, key, exc in self._run_reads(jobs):
                if exc is None:
                    outcome.hits.append(encode_key(key))
                else:
                    outcome.faults.append((key, exc.reason))
                    outcome.reasons[i] = exc.reason.miss_reason
        outcome.faults += [(key, QuarantineReason.INDEX_VALUE) for key in corrupt_values]
        return outcome

    def _run_reads(self, jobs: list[_ReadJob]) -> list[tuple[int, ObjectKey, CorruptRecord | None]]:
        def one(job: _ReadJob) -> tuple[int, ObjectKey, CorruptRecord | None]:
            i, key, entry, out = job
            try:
                self.read_record(key, entry, out)
                return i, key, None
            except CorruptRecord as exc:
                return i, key, exc

        if len(jobs) <= 1:
            return [one(j) for j in jobs]
        return list(self._ctx.executor("read").map(one, jobs))

    def read_record(self, key: ObjectKey, entry: IndexEntry, out: torch.Tensor | None) -> None:
        """Read one record, verify header against the index and the payload checksum, then fill `out`."""
        seg = self.segment(entry.segment)
        if out is not None and out.is_cuda and self._ctx.backend.device_reads and entry.codec is Codec.NONE:
            self._read_record_device(key, entry, seg, out)
            return
        buf = self.fetch_checked(key, entry, seg)
        try:
            if entry.codec is Codec.ZSTD:
                self._decode_into(buf.mv[HEADER_BYTES : HEADER_BYTES + entry.stored_len], entry.payload_len, out)
            elif out is not None:
                out.copy_(buf.tensor[HEADER_BYTES : HEADER_BYTES + entry.payload_len])
        finally:
            self._ctx.buffers.release(buf)

    def fetch_checked(self, key: ObjectKey, entry: IndexEntry, seg: SegmentFile) -> AlignedBuffer:
        """The whole record in a pooled buffer (the caller releases it), header and payload checksum verified."""
        buffers = self._ctx.buffers
        buf = buffers.acquire(entry.record_len)
        try:
            got = seg.pread_into(buf.mv[: entry.record_len], entry.offset)
            if got < entry.record_len:
                raise CorruptRecord(
                    QuarantineReason.SEGMENT_TRUNCATED, f"segment {entry.segment:016x} ends inside the record"
                )
            check_header(RecordHeader.unpack(buf.mv[:HEADER_BYTES]), key, entry)
            if payload_checksum(buf.mv[HEADER_BYTES : HEADER_BYTES + entry.stored_len]) != entry.payload_checksum:
                raise CorruptRecord(QuarantineReason.PAYLOAD, "payload checksum mismatch")
            return buf
        except BaseException:
            buffers.release(buf)
            raise

    def _decode_into(self, stored: memoryview, payload_len: int, out: torch.Tensor | None) -> None:
        plain = self._ctx.buffers.acquire(payload_len)
        try:
            zstd_decompress_into(stored, plain.mv[:payload_len])
            if out is not None:
                out.copy_(plain.tensor[:payload_len])
        finally:
            self._ctx.buffers.release(plain)

    def _read_record_device(self, key: ObjectKey, entry: IndexEntry, seg: SegmentFile, out: torch.Tensor) -> None:
        """GDS: payload straight into the device slot; checksum on a host copy before it counts as loaded."""
        buf = self._ctx.buffers.acquire(HEADER_BYTES + entry.payload_len)
        try:
            if seg.pread_into(buf.mv[:HEADER_BYTES], entry.offset) < HEADER_BYTES:
                raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the header")
            check_header(RecordHeader.unpack(buf.mv[:HEADER_BYTES]), key, entry)
            if self._ctx.backend.read_device(seg, out, entry.offset + HEADER_BYTES) < entry.payload_len:
                raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the payload")
            host = buf.tensor[HEADER_BYTES : HEADER_BYTES + entry.payload_len]
            host.copy_(out)
            if payload_checksum(buf.mv[HEADER_BYTES : HEADER_BYTES + entry.payload_len]) != entry.payload_checksum:
                raise CorruptRecord(QuarantineReason.PAYLOAD, "payload checksum mismatch")
        finally:
            self._ctx.buffers.release(buf)

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


class AccessTimes:
    """Access times noted in memory and flushed in one write txn every `atime_flush_s` (LRU is advisory)."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self._pending: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._flushed = time.monotonic()

    def touch(self, raw_keys: list[bytes]) -> None:
        if not raw_keys:
            return
        now = time.time()
        with self._lock:
            for k in raw_keys:
                self._pending[k] = now
            due = time.monotonic() - self._flushed >= self._ctx.config.atime_flush_s or len(self._pending) >= 4096
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._flushed = time.monotonic()
        if not pending:
            return
        index = self._ctx.index

        def put(txn: lmdb.Transaction) -> None:
            for k, t in pending.items():
                if txn.get(k, db=index.obj) is not None:
                    txn.put(k, pack_time(t), db=index.atime)

        index.update(put)


def check_header(h: RecordHeader, key: ObjectKey, e: IndexEntry) -> None:
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
    ):
        raise CorruptRecord(QuarantineReason.HEADER_MISMATCH, "record header does not match its index entry")
