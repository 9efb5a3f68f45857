"""DiskStore: the on-disk prefix store, a LowerTier keyed by (namespace, block hash, group, form)."""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lmdb
import torch

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.store.errors import (
    CorruptRecord,
    NamespaceError,
    QuarantineReason,
    StoreForkError,
    StoreFull,
    StoreReadOnly,
    StoreRequestError,
)
from kvtier.store.index import (
    Index,
    IndexEntry,
    NamespaceEntry,
    RecordState,
    SegmentEntry,
    decode_key,
    encode_key,
    pack_time,
    seal,
    u64_key,
    unpack_time,
    unseal,
)
from kvtier.store.io import AlignedBuffer, BufferPool, PosixBackend, SegmentFile, select_backend
from kvtier.store.record import (
    HEADER_BYTES,
    MAX_VERSION_KEY_BYTES,
    Codec,
    RecordHeader,
    payload_checksum,
    record_length,
    zstd_compress,
    zstd_decompress_into,
)
from kvtier.store.segments import SEGMENTS_DIR, Appender, WriterLock, seal_segment, segment_name

log = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_META_DOCS = frozenset({"verifier"})  # JSON documents other processes may keep in `meta` (FORMAT.md)


@dataclasses.dataclass(frozen=True, slots=True)
class StoreConfig:
    """Knobs of one store; the budget and quotas count record bytes on disk (header + padded payload)."""

    budget_bytes: int = 0  # 0: no budget
    form_quotas: tuple[tuple[CacheForm, int], ...] = ()
    segment_bytes: int = 1 << 30
    io_threads: int = 4
    io_backend: str = "auto"  # auto | gds | odirect | buffered
    min_free_bytes: int | None = 1 << 20  # refuse writes that would leave less free space; None: no check
    atime_flush_s: float = 5.0
    buffer_retain_bytes: int = 256 << 20

    @staticmethod
    def quotas(mapping: Mapping[CacheForm, int]) -> tuple[tuple[CacheForm, int], ...]:
        return tuple(sorted(mapping.items(), key=lambda kv: kv[0].value))


@dataclasses.dataclass(frozen=True, slots=True)
class StoreLimits:
    """The byte budget and per-form quotas the writer enforces, as it published them in the index (0: none)."""

    budget_bytes: int = 0
    form_quotas: tuple[tuple[CacheForm, int], ...] = ()

    def quota(self, form: CacheForm) -> int:
        return dict(self.form_quotas).get(form, 0)


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


@dataclasses.dataclass(slots=True)
class _Prepared:
    key: ObjectKey
    header: RecordHeader
    layout_digest: bytes
    buf: AlignedBuffer


class DiskStore:
    """The disk tier. Open one per process (after any fork); `writer=True` only in the daemon."""

    def __init__(
        self, root: str, config: StoreConfig = StoreConfig(), *, writer: bool = False, readonly: bool = False
    ) -> None:
        if writer and readonly:
            raise ValueError("a store cannot be both writer and read-only")
        self.root = os.path.abspath(root)
        self.config = config
        self.readonly = readonly
        self._pid = os.getpid()
        seg_dir = os.path.join(self.root, SEGMENTS_DIR)
        if not readonly:
            os.makedirs(seg_dir, exist_ok=True)
        self._writer_lock = WriterLock(self.root) if writer else None
        try:
            self.index = Index(self.root, readonly=readonly)
            self.backend: PosixBackend = select_backend(seg_dir, config.io_backend, readonly=readonly)
        except BaseException:
            if self._writer_lock:
                self._writer_lock.release()
            raise
        self._seg_dir = seg_dir
        self._buffers = BufferPool(config.buffer_retain_bytes)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._files: dict[int, SegmentFile] = {}
        self._files_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._atime: dict[bytes, float] = {}
        self._atime_lock = threading.Lock()
        self._atime_flushed = time.monotonic()
        self._quotas = dict(config.form_quotas)
        self._appender: Appender | None = None
        self._relocator: Appender | None = None  # the cleaner's compaction segments (never the daemon's)
        if writer:
            self._appender = Appender(self.root, self.index, self.backend, config.segment_bytes)
            self.seal_abandoned_segments()
            self._publish_limits()

    # ----------------------------------------------------------------- properties

    @property
    def io_backend(self) -> str:
        """'gds', 'odirect' or 'buffered' (the last only where the filesystem refuses O_DIRECT)."""
        return self.backend.name

    @property
    def is_writer(self) -> bool:
        return self._appender is not None

    # ----------------------------------------------------------------- namespaces

    def register_namespace(
        self, version_key: VersionKey, *, live: bool = True, codecs: Mapping[CacheForm, str] | None = None
    ) -> bytes:
        """Register (or update) a namespace with its full version key; codecs per form default to none."""
        self._check_pid()
        if len(version_key.canonical()) > MAX_VERSION_KEY_BYTES:
            raise NamespaceError(f"version key is over {MAX_VERSION_KEY_BYTES} bytes as JSON: shorten its fields")
        codec_pairs = tuple(sorted((f.value, Codec.parse(c).name.lower()) for f, c in (codecs or {}).items()))
        ns = version_key.namespace
        now = time.time()

        def put(txn: lmdb.Transaction) -> None:
            old = self._namespace(txn, ns)
            registered = old.registered_at if old else now
            entry = NamespaceEntry(version_key, live, registered, 0.0 if live else now, codec_pairs)
            txn.put(ns, entry.pack(), db=self.index.dbs["ns"])

        self.index.update(put)
        return ns

    def retire_namespace(self, namespace: bytes) -> bool:
        """Mark a namespace retired: its records become misses (stale_version) at once; returns if it existed."""
        self._check_pid()

        def put(txn: lmdb.Transaction) -> bool:
            old = self._namespace(txn, namespace)
            if old is None:
                return False
            txn.put(
                namespace, dataclasses.replace(old, live=False, retired_at=time.time()).pack(), db=self.index.dbs["ns"]
            )
            return True

        return self.index.update(put)

    def namespaces(self) -> dict[bytes, NamespaceEntry]:
        self._check_pid()
        with self.index.read() as txn:
            return {bytes(k): NamespaceEntry.unpack(v) for k, v in txn.cursor(db=self.index.dbs["ns"])}

    def _namespace(self, txn: lmdb.Transaction, ns: bytes) -> NamespaceEntry | None:
        raw = txn.get(ns, db=self.index.dbs["ns"])
        return None if raw is None else NamespaceEntry.unpack(raw)

    # ----------------------------------------------------------------- LowerTier: lookups

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        """Index-only check per key: OK if a load would be attempted, else why not."""
        self._check_pid()
        if len(keys) != len(layout_digests):
            raise StoreRequestError("has(): keys and layout_digests differ in length: pass one digest per key")
        out: list[Reason] = []
        corrupt: list[ObjectKey] = []
        with self.index.read() as txn:
            ns_cache: dict[bytes, NamespaceEntry | None] = {}
            for key, digest in zip(keys, layout_digests):
                reason, _ = self._lookup(txn, key, digest, ns_cache, corrupt)
                out.append(reason)
        self._quarantine_index_values(corrupt)
        return out

    def _lookup(
        self,
        txn: lmdb.Transaction,
        key: ObjectKey,
        digest: bytes,
        ns_cache: dict[bytes, NamespaceEntry | None],
        corrupt: list[ObjectKey],
    ) -> tuple[Reason, IndexEntry | None]:
        if key.namespace not in ns_cache:
            try:
                ns_cache[key.namespace] = self._namespace(txn, key.namespace)
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
        raw = txn.get(raw_key, db=self.index.dbs["obj"])
        if raw is None:
            gone = self.index.dbs["gone"]
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

    # ----------------------------------------------------------------- LowerTier: loads

    def load_into(self, requests: Sequence[LoadRequest]) -> list[Reason]:
        """Read, verify and copy each record into its `out`; batched over the I/O thread pool.

        The read transaction stays open across the batch's reads: LMDB's reader table is the epoch
        that keeps the cleaner from unlinking a segment this batch could still read (FORMAT.md).
        """
        self._check_pid()
        results = [Reason.MISSING] * len(requests)
        failures: list[tuple[ObjectKey, QuarantineReason]] = []
        corrupt_values: list[ObjectKey] = []
        hits: list[bytes] = []
        with self.index.read() as txn:
            ns_cache: dict[bytes, NamespaceEntry | None] = {}
            jobs: list[tuple[int, ObjectKey, IndexEntry, torch.Tensor]] = []
            for i, req in enumerate(requests):
                out = _flat_uint8(req.out)
                reason, entry = self._lookup(txn, req.key, req.layout_digest, ns_cache, corrupt_values)
                if entry is not None and entry.payload_len != out.numel():
                    reason = Reason.ABI_MISMATCH
                if reason is Reason.OK and entry is not None:
                    jobs.append((i, req.key, entry, out))
                results[i] = reason
            for i, key, exc in self._run_reads(jobs):
                if exc is None:
                    hits.append(encode_key(key))
                else:
                    failures.append((key, exc.reason))
                    results[i] = exc.reason.miss_reason
        for key, why in failures:
            log.warning("quarantining %s: %s", _key_str(key), why.label)
            self.quarantine(key, why)
        self._quarantine_index_values(corrupt_values)
        self._touch(hits)
        return results

    def _run_reads(
        self, jobs: list[tuple[int, ObjectKey, IndexEntry, torch.Tensor]]
    ) -> list[tuple[int, ObjectKey, CorruptRecord | None]]:
        def one(job: tuple[int, ObjectKey, IndexEntry, torch.Tensor]) -> tuple[int, ObjectKey, CorruptRecord | None]:
            i, key, entry, out = job
            try:
                self._read_record(key, entry, out)
                return i, key, None
            except CorruptRecord as exc:
                return i, key, exc

        if len(jobs) <= 1:
            return [one(j) for j in jobs]
        return list(self._executor("read").map(one, jobs))

    def _read_record(self, key: ObjectKey, entry: IndexEntry, out: torch.Tensor | None) -> None:
        """Read one record, verify header against the index and the payload checksum, then fill `out`."""
        seg = self._segment(entry.segment)
        if out is not None and out.is_cuda and self.backend.device_reads and entry.codec is Codec.NONE:
            self._read_record_device(key, entry, seg, out)
            return
        buf = self._fetch_checked(key, entry, seg)
        try:
            if entry.codec is Codec.ZSTD:
                self._decode_into(buf.mv[HEADER_BYTES : HEADER_BYTES + entry.stored_len], entry.payload_len, out)
            elif out is not None:
                out.copy_(buf.tensor[HEADER_BYTES : HEADER_BYTES + entry.payload_len])
        finally:
            self._buffers.release(buf)

    def _fetch_checked(self, key: ObjectKey, entry: IndexEntry, seg: SegmentFile) -> AlignedBuffer:
        """The whole record in a pooled buffer (the caller releases it), header and payload checksum verified."""
        buf = self._buffers.acquire(entry.record_len)
        try:
            got = seg.pread_into(buf.mv[: entry.record_len], entry.offset)
            if got < entry.record_len:
                raise CorruptRecord(
                    QuarantineReason.SEGMENT_TRUNCATED, f"segment {entry.segment:016x} ends inside the record"
                )
            _check_header(RecordHeader.unpack(buf.mv[:HEADER_BYTES]), key, entry)
            if payload_checksum(buf.mv[HEADER_BYTES : HEADER_BYTES + entry.stored_len]) != entry.payload_checksum:
                raise CorruptRecord(QuarantineReason.PAYLOAD, "payload checksum mismatch")
            return buf
        except BaseException:
            self._buffers.release(buf)
            raise

    def _decode_into(self, stored: memoryview, payload_len: int, out: torch.Tensor | None) -> None:
        plain = self._buffers.acquire(payload_len)
        try:
            zstd_decompress_into(stored, plain.mv[:payload_len])
            if out is not None:
                out.copy_(plain.tensor[:payload_len])
        finally:
            self._buffers.release(plain)

    def _read_record_device(self, key: ObjectKey, entry: IndexEntry, seg: SegmentFile, out: torch.Tensor) -> None:
        """GDS: payload straight into the device slot; checksum on a host copy before it counts as loaded."""
        buf = self._buffers.acquire(HEADER_BYTES + entry.payload_len)
        try:
            if seg.pread_into(buf.mv[:HEADER_BYTES], entry.offset) < HEADER_BYTES:
                raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the header")
            _check_header(RecordHeader.unpack(buf.mv[:HEADER_BYTES]), key, entry)
            if self.backend.read_device(seg, out, entry.offset + HEADER_BYTES) < entry.payload_len:
                raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the payload")
            host = buf.tensor[HEADER_BYTES : HEADER_BYTES + entry.payload_len]
            host.copy_(out)
            if payload_checksum(buf.mv[HEADER_BYTES : HEADER_BYTES + entry.payload_len]) != entry.payload_checksum:
                raise CorruptRecord(QuarantineReason.PAYLOAD, "payload checksum mismatch")
        finally:
            self._buffers.release(buf)

    def _segment(self, seg_id: int) -> SegmentFile:
        with self._files_lock:
            seg = self._files.get(seg_id)
            if seg is None:
                try:
                    seg = self.backend.open(os.path.join(self._seg_dir, segment_name(seg_id)))
                except FileNotFoundError:
                    raise CorruptRecord(QuarantineReason.SEGMENT_MISSING, f"segment {seg_id:016x} is gone") from None
                self._files[seg_id] = seg
            return seg

    # ----------------------------------------------------------------- LowerTier: writes

    def store(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes) -> None:
        """Persist one sealed object; durable (fdatasync + LMDB commit) when it returns."""
        self.store_many([(key, payload, layout_digest)])

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        """Persist objects with one fdatasync per segment and one commit: all visible, or none (StoreFull)."""
        self._check_pid()
        if self._appender is None:
            raise StoreReadOnly("this store was opened without the writer role: only the kvtier daemon stores objects")
        for key, payload, digest in items:
            _flat_uint8(payload)
            if len(digest) != 16:
                raise StoreRequestError(f"layout digest for {_key_str(key)} must be 16 bytes")
        with self._write_lock:
            todo, namespaces = self._admit(items)
            if todo:
                self._write_batch(todo, namespaces)

    def _admit(
        self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]
    ) -> tuple[list[tuple[ObjectKey, torch.Tensor, bytes]], dict[bytes, NamespaceEntry]]:
        """Drop items already live (records are immutable, keys content-addressed); check namespaces."""
        todo: list[tuple[ObjectKey, torch.Tensor, bytes]] = []
        namespaces: dict[bytes, NamespaceEntry] = {}
        seen: set[bytes] = set()
        with self.index.read() as txn:
            for key, payload, digest in items:
                if key.namespace not in namespaces:
                    ns = self._namespace(txn, key.namespace)
                    if ns is None or not ns.live:
                        state = "not registered" if ns is None else "retired"
                        raise NamespaceError(
                            f"namespace {key.namespace.hex()} is {state}: register its version key first"
                        )
                    namespaces[key.namespace] = ns
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=self.index.dbs["obj"])
                if raw_key in seen or (raw is not None and _is_live(raw)):
                    continue
                seen.add(raw_key)
                todo.append((key, payload, digest))
            usage = self.index.usage(txn)
        for key, payload, _ in todo:  # exact for uncompressed records; compressed ones are checked at commit
            if namespaces[key.namespace].codec_for(key.form) is Codec.NONE:
                usage[key.form].record_bytes += record_length(payload.numel())
        self._check_budget(usage)
        return todo, namespaces

    def _write_batch(
        self, items: list[tuple[ObjectKey, torch.Tensor, bytes]], namespaces: dict[bytes, NamespaceEntry]
    ) -> None:
        assert self._appender is not None
        appender = self._appender
        now = time.time()
        window = max(2, 2 * self.config.io_threads)
        pending: collections.deque[Future[tuple[_Prepared, int, int]]] = collections.deque()
        written: list[tuple[_Prepared, int, int]] = []
        appender.begin_batch()
        sync_failed = False
        try:
            for key, payload, digest in items:
                codec = namespaces[key.namespace].codec_for(key.form)
                vk = namespaces[key.namespace].version_key.canonical()
                if len(items) == 1:  # a single record: no hop through the pool
                    written.append(self._prepare_and_write(key, payload, digest, codec, vk, now))
                    continue
                if len(pending) >= window:
                    written.append(pending.popleft().result())
                pending.append(
                    self._executor("write").submit(self._prepare_and_write, key, payload, digest, codec, vk, now)
                )
            while pending:
                written.append(pending.popleft().result())
            try:
                appender.sync_batch()
            except OSError:
                sync_failed = True
                raise
            self.index.update(lambda txn: self._commit(txn, written, appender.batch_segments()))
        except OSError as exc:
            self._drain(pending)
            appender.rewind(abandon=sync_failed)
            if exc.errno in _DISK_FULL:
                raise StoreFull(
                    f"{self.root}: filesystem full ({exc.strerror}): let the cleaner evict, or grow the disk",
                    limit="disk",
                ) from None
            raise
        except lmdb.DiskError as exc:
            appender.rewind(abandon=False)
            raise StoreFull(f"{self.root}: index could not grow ({exc}): free disk space", limit="disk") from None
        except BaseException:
            self._drain(pending)
            appender.rewind(abandon=False)
            raise
        finally:
            appender.end_batch()
            for prep, _, _ in written:
                self._buffers.release(prep.buf)

    def _drain(self, pending: collections.deque[Future[tuple[_Prepared, int, int]]]) -> None:
        for fut in pending:
            try:
                prep, _, _ = fut.result()
                self._buffers.release(prep.buf)
            except BaseException:  # the first error is the one reported
                pass
        pending.clear()

    def _prepare_and_write(
        self, key: ObjectKey, payload: torch.Tensor, digest: bytes, codec: Codec, vk: bytes, now: float
    ) -> tuple[_Prepared, int, int]:
        """Pool task: stage header + payload in an aligned buffer, checksum, place at the tail, pwrite."""
        flat = _flat_uint8(payload)
        n = flat.numel()
        stored_bytes: bytes | None = None
        if codec is Codec.ZSTD:
            stored_bytes = zstd_compress(flat.cpu().numpy().data)
            stored_len = len(stored_bytes)
        else:
            stored_len = n
        record_len = record_length(stored_len)
        self._check_budget_fast(key.form, record_len)
        buf = self._buffers.acquire(record_len)
        try:
            if stored_bytes is None:
                buf.tensor[HEADER_BYTES : HEADER_BYTES + n].copy_(flat)
            else:
                buf.mv[HEADER_BYTES : HEADER_BYTES + stored_len] = stored_bytes
            pad_at = HEADER_BYTES + stored_len
            buf.mv[pad_at:record_len] = bytes(record_len - pad_at)
            header = RecordHeader(
                key.namespace,
                key.block_hash,
                key.group,
                key.form,
                digest,
                codec,
                n,
                stored_len,
                now,
                payload_checksum(buf.mv[HEADER_BYTES:pad_at]),
                vk,
            )
            header.pack_into(buf.mv)
            prep = _Prepared(key, header, digest, buf)
            assert self._appender is not None
            place = self._appender.place(record_len)
            place.file.pwrite_all(buf.mv[:record_len], place.offset)
            return prep, place.seg_id, place.offset
        except BaseException:
            self._buffers.release(buf)
            raise

    def _check_budget_fast(self, form: CacheForm, record_len: int) -> None:
        """Cheap pre-write check of the filesystem's free space (the budget is checked in the commit)."""
        if self.config.min_free_bytes is None:
            return
        st = os.statvfs(self._seg_dir)
        if st.f_blocks and st.f_bavail * st.f_frsize < record_len + self.config.min_free_bytes:  # ramfs reports 0
            raise StoreFull(
                f"{self.root}: {st.f_bavail * st.f_frsize} bytes free, a {form.value} record needs {record_len} "
                f"plus {self.config.min_free_bytes} reserved: let the cleaner evict, or grow the disk",
                limit="disk",
            )

    def _commit(self, txn: lmdb.Transaction, written: list[tuple[_Prepared, int, int]], segments: list[int]) -> None:
        usage = self.index.usage(txn)
        seq = self.index.get_meta_u64(txn, b"seq", 1)
        seg_db, obj_db = self.index.dbs["seg"], self.index.dbs["obj"]
        seg_entries = {s: SegmentEntry.unpack(txn.get(u64_key(s), db=seg_db)) for s in segments}
        for prep, seg_id, offset in written:
            h = prep.header
            ns = self._namespace(txn, h.namespace)
            if ns is None or not ns.live:
                raise NamespaceError(f"namespace {h.namespace.hex()} was retired during the write: nothing stored")
            entry = IndexEntry(
                RecordState.LIVE,
                h.form,
                h.codec,
                seg_id,
                offset,
                h.record_len,
                h.payload_len,
                h.stored_len,
                h.payload_checksum,
                prep.layout_digest,
                seq,
                h.created,
            )
            raw_key = encode_key(prep.key)
            old = txn.get(raw_key, db=obj_db)
            if old is not None:  # a quarantined record is replaced
                self._unaccount(txn, old, usage, seg_entries, raw_key)
            usage[h.form].add(h.record_len, h.payload_len, h.stored_len, +1)
            txn.put(raw_key, entry.pack(), db=obj_db)
            txn.delete(raw_key, db=self.index.dbs["gone"])  # stored again after an eviction
            txn.put(u64_key(seq), raw_key, db=self.index.dbs["dirty"])
            txn.put(raw_key, pack_time(h.created), db=self.index.dbs["atime"])
            seg = seg_entries[seg_id]
            seg_entries[seg_id] = dataclasses.replace(
                seg,
                tail=max(seg.tail, offset + h.record_len),
                referenced=seg.referenced + h.record_len,
                records=seg.records + 1,
            )
            seq += 1
        self._check_budget(usage)
        for seg_id, seg in seg_entries.items():
            txn.put(u64_key(seg_id), seg.pack(), db=seg_db)
        self.index.put_meta_u64(txn, b"seq", seq)
        self.index.put_usage(txn, usage)

    def _check_budget(self, usage: dict[CacheForm, Any]) -> None:
        total = sum(u.record_bytes for u in usage.values())
        if self.config.budget_bytes and total > self.config.budget_bytes:
            raise StoreFull(
                f"{self.root}: write would bring the store to {total} bytes, over its budget of "
                f"{self.config.budget_bytes}: let the cleaner evict, or raise the budget",
                limit="budget",
            )
        for form, quota in self._quotas.items():
            if usage[form].record_bytes > quota:
                raise StoreFull(
                    f"{self.root}: {form.value} records would use {usage[form].record_bytes} bytes, over the "
                    f"{form.value} quota of {quota}: let the cleaner evict, or raise the quota",
                    limit=f"quota:{form.value}",
                )

    def _unaccount(
        self,
        txn: lmdb.Transaction,
        raw: bytes,
        usage: dict[CacheForm, Any],
        seg_entries: dict[int, SegmentEntry],
        raw_key: bytes,
    ) -> None:
        """Remove an old record's bytes from usage and its segment's referenced count (best effort if corrupt)."""
        try:
            old = IndexEntry.unpack(raw)
        except CorruptRecord:
            return
        usage[old.form].add(old.record_len, old.payload_len, old.stored_len, -1)
        txn.delete(u64_key(old.seq), db=self.index.dbs["dirty"])
        seg = seg_entries.get(old.segment)
        if seg is None:
            seg_raw = txn.get(u64_key(old.segment), db=self.index.dbs["seg"])
            if seg_raw is None:
                return
            seg = SegmentEntry.unpack(seg_raw)
        seg_entries[old.segment] = dataclasses.replace(
            seg,
            referenced=max(0, seg.referenced - old.record_len),
            records=max(0, seg.records - 1),
            last_drop_txn=txn.id(),
        )

    # ----------------------------------------------------------------- LowerTier: pins and removal

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> int:
        """Protect records from eviction until now + ttl_s (extends, never shortens); returns how many exist."""
        self._check_pid()
        until = time.time() + ttl_s

        def put(txn: lmdb.Transaction) -> int:
            found = 0
            for key in keys:
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=self.index.dbs["obj"])
                if raw is None:
                    continue
                try:
                    entry = IndexEntry.unpack(raw)
                except CorruptRecord:
                    continue
                found += 1
                if entry.pin_until < until:
                    txn.put(raw_key, dataclasses.replace(entry, pin_until=until).pack(), db=self.index.dbs["obj"])
            return found

        return self.index.update(put)

    def remove(self, keys: Sequence[ObjectKey]) -> int:
        return self.drop(keys)

    def evict(
        self, keys: Iterable[ObjectKey], *, when: Callable[[ObjectKey, IndexEntry | None], bool] | None = None
    ) -> int:
        """`drop` to make room, leaving a tombstone per key (`gone`): until it is stored again or the cleaner
        prunes the tombstone, lookups and loads answer `evicted` rather than `missing`."""
        return self.drop(keys, when=when, tombstone=True)

    def drop(
        self,
        keys: Iterable[ObjectKey],
        *,
        when: Callable[[ObjectKey, IndexEntry | None], bool] | None = None,
        tombstone: bool = False,
    ) -> int:
        """Delete index entries (the bytes stay until their segment is reclaimed); returns how many were deleted.

        `when`, if given, is asked inside the write transaction about each indexed key's current entry (None: its
        value is corrupt); only keys it accepts are dropped, so a cleaner's decision cannot hit a record that changed.
        """
        self._check_pid()
        pairs = [(k, encode_key(k)) for k in keys]
        stamp = pack_time(time.time())

        def put(txn: lmdb.Transaction) -> int:
            usage = self.index.usage(txn)
            seg_entries: dict[int, SegmentEntry] = {}
            n = 0
            for key, raw_key in pairs:
                raw = txn.get(raw_key, db=self.index.dbs["obj"])
                if raw is None or (when is not None and not when(key, _entry_or_none(raw))):
                    continue
                self._unaccount(txn, raw, usage, seg_entries, raw_key)
                txn.delete(raw_key, db=self.index.dbs["obj"])
                txn.delete(raw_key, db=self.index.dbs["atime"])
                if tombstone:
                    txn.put(raw_key, stamp, db=self.index.dbs["gone"])
                n += 1
            for seg_id, seg in seg_entries.items():
                txn.put(u64_key(seg_id), seg.pack(), db=self.index.dbs["seg"])
            self.index.put_usage(txn, usage)
            return n

        return self.index.update(put)

    # ----------------------------------------------------------------- verifier / cleaner primitives

    def prune_tombstones(self, older_than: float, *, start: bytes = b"", scan: int = 4096) -> tuple[int, bytes]:
        """Forget eviction tombstones written before `older_than` (unix time; a corrupt one goes too): those
        keys read as missing again. Looks at most `scan` tombstones from key `start` in one short transaction;
        returns (how many went, the key to resume from: b"" once the end was reached)."""
        self._check_pid()

        def put(txn: lmdb.Transaction) -> tuple[int, bytes]:
            n = 0
            with txn.cursor(db=self.index.dbs["gone"]) as cur:
                more = cur.set_range(start) if start else cur.first()
                for _ in range(scan):
                    if not more:
                        return n, b""
                    try:
                        expired = unpack_time(cur.value()) < older_than
                    except CorruptRecord:
                        expired = True
                    if expired:
                        cur.delete()  # moves to the next entry; past the last one the cursor is unset
                        more = bool(cur.key())
                        n += 1
                    else:
                        more = cur.next()
                return n, (bytes(cur.key()) if more else b"")

        return self.index.update(put)

    def quarantine(self, key: ObjectKey, reason: QuarantineReason) -> bool:
        """Take a record out of service with reason and time (readers get a miss); False if it is not indexed."""
        self._check_pid()
        raw_key = encode_key(key)
        now = time.time()

        def put(txn: lmdb.Transaction) -> bool:
            raw = txn.get(raw_key, db=self.index.dbs["obj"])
            if raw is None:
                return False
            try:
                entry = IndexEntry.unpack(raw)
            except CorruptRecord:  # location unknown: keep a tombstone so the key reads as corrupt
                entry = IndexEntry(
                    RecordState.QUARANTINED, key.form, Codec.NONE, 0, 0, 0, 0, 0, bytes(16), bytes(16), 0, now
                )
            txn.put(
                raw_key,
                dataclasses.replace(
                    entry, state=RecordState.QUARANTINED, quarantine_reason=int(reason), quarantined_at=now
                ).pack(),
                db=self.index.dbs["obj"],
            )
            return True

        return self.index.update(put)

    def _quarantine_index_values(self, keys: list[ObjectKey]) -> None:
        for key in keys:
            log.warning("quarantining %s: index value checksum mismatch", _key_str(key))
            self.quarantine(key, QuarantineReason.INDEX_VALUE)

    def verify(self, key: ObjectKey) -> Reason:
        """Read and check one record without loading it anywhere; quarantines on failure, stamps verified_at."""
        return self.verify_many([key])[0].reason

    def verify_many(self, keys: Sequence[ObjectKey], *, apply: bool = True) -> list[VerifyResult]:
        """Read and check records in one short read transaction (bound the batch); with `apply`, quarantine the
        failures and stamp verified_at (clearing dirty) on the good ones in one write transaction."""
        self._check_pid()
        results: list[VerifyResult] = []
        failures: list[tuple[ObjectKey, QuarantineReason]] = []
        good: list[tuple[bytes, bytes, IndexEntry]] = []
        with self.index.read() as txn:
            for key in keys:
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=self.index.dbs["obj"])
                if raw is None:
                    results.append(VerifyResult(Reason.MISSING))
                    continue
                entry = _entry_or_none(raw)
                if entry is None:
                    failures.append((key, QuarantineReason.INDEX_VALUE))
                elif entry.state is RecordState.QUARANTINED:
                    results.append(VerifyResult(QuarantineReason(entry.quarantine_reason).miss_reason))
                    continue
                else:
                    try:
                        self._read_record(key, entry, None)
                        good.append((raw_key, bytes(raw), entry))
                        results.append(VerifyResult(Reason.OK))
                        continue
                    except CorruptRecord as exc:
                        failures.append((key, exc.reason))
                why = failures[-1][1]
                results.append(VerifyResult(why.miss_reason, why))
        if not apply:
            return results
        for key, why in failures:
            log.warning("quarantining %s: %s", _key_str(key), why.label)
            self.quarantine(key, why)
        now = time.time()

        def stamp(txn: lmdb.Transaction) -> None:
            for raw_key, raw, entry in good:
                cur = txn.get(raw_key, db=self.index.dbs["obj"])
                if cur is not None and bytes(cur) == raw:  # unchanged since the read
                    txn.put(raw_key, dataclasses.replace(entry, verified_at=now).pack(), db=self.index.dbs["obj"])
                    txn.delete(u64_key(entry.seq), db=self.index.dbs["dirty"])

        if good:
            self.index.update(stamp)
        return results

    def records(self, keys: Sequence[ObjectKey]) -> list[RecordInfo | None]:
        """The index rows of `keys` (None where a key is not indexed), in one short read transaction."""
        self._check_pid()
        with self.index.read() as txn:
            atimes = txn.cursor(db=self.index.dbs["atime"])
            out: list[RecordInfo | None] = []
            for key in keys:
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=self.index.dbs["obj"])
                out.append(None if raw is None else RecordInfo(key, _entry_or_none(raw), _atime(atimes.get(raw_key))))
            return out

    def iter_records(
        self, after: ObjectKey | None = None, limit: int = 256, namespace: bytes | None = None
    ) -> list[RecordInfo]:
        """Up to `limit` records in key order after `after` (one short read txn per call)."""
        self._check_pid()
        start = encode_key(after) if after is not None else (namespace or b"")
        out: list[RecordInfo] = []
        with self.index.read() as txn:
            cur = txn.cursor(db=self.index.dbs["obj"])
            atimes = txn.cursor(db=self.index.dbs["atime"])
            if not cur.set_range(start):
                return out
            if after is not None and cur.key() == start and not cur.next():
                return out
            for raw_key, raw in cur:
                if namespace is not None and not raw_key.startswith(namespace):
                    break
                out.append(RecordInfo(decode_key(bytes(raw_key)), _entry_or_none(raw), _atime(atimes.get(raw_key))))
                if len(out) >= limit:
                    break
        return out

    def iter_dirty(self, after_seq: int = 0, limit: int = 256) -> list[tuple[int, ObjectKey]]:
        """Records written (and not verified) since the last verification, oldest first: (seq, key)."""
        self._check_pid()
        out: list[tuple[int, ObjectKey]] = []
        with self.index.read() as txn:
            cur = txn.cursor(db=self.index.dbs["dirty"])
            if not cur.set_range(u64_key(after_seq + 1)):
                return out
            for raw_seq, raw_key in cur:
                out.append((int.from_bytes(raw_seq, "big"), decode_key(bytes(raw_key))))
                if len(out) >= limit:
                    break
        return out

    def segments(self) -> dict[int, SegmentEntry]:
        self._check_pid()
        with self.index.read() as txn:
            return {int.from_bytes(k, "big"): SegmentEntry.unpack(v) for k, v in txn.cursor(db=self.index.dbs["seg"])}

    def seal_abandoned_segments(self) -> int:
        """Seal unsealed segments whose appender is gone (its flock is free); returns how many."""
        self._check_pid()
        owned = self._appender.owned_segment if self._appender else 0
        stale = []
        for seg_id, entry in self.segments().items():
            if entry.sealed or seg_id == owned:
                continue
            try:
                probe = self.backend.open(os.path.join(self._seg_dir, segment_name(seg_id)))
            except FileNotFoundError:
                stale.append(seg_id)
                continue
            try:
                if probe.try_lock():
                    stale.append(seg_id)
            finally:
                probe.close()
        if stale:
            self.index.update(lambda txn: [seal_segment(self.index, txn, s) for s in stale])
        return len(stale)

    def try_unlink_segment(self, seg_id: int) -> bool:
        """Unlink a sealed segment that no record references, once no reader can still see a dropped record in it."""
        self._check_pid()
        with self.index.read() as txn:
            raw = txn.get(u64_key(seg_id), db=self.index.dbs["seg"])
        if raw is None:
            return False
        entry = SegmentEntry.unpack(raw)
        if not entry.sealed or entry.referenced:
            return False
        oldest = self.index.oldest_reader_txnid()
        if oldest is not None and oldest < entry.last_drop_txn:
            return False
        path = os.path.join(self._seg_dir, segment_name(seg_id))
        probe = self._lock_segment(path)
        if probe is False:
            return False  # an appender still holds it (a segment rolled mid-batch is sealed before its batch commits)

        def put(txn: lmdb.Transaction) -> bool:
            cur = txn.get(u64_key(seg_id), db=self.index.dbs["seg"])
            if cur is None or bytes(cur) != bytes(raw):
                return False
            txn.delete(u64_key(seg_id), db=self.index.dbs["seg"])
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return True

        try:
            return self.index.update(put)
        finally:
            if probe is not None:
                probe.close()

    def _lock_segment(self, path: str) -> SegmentFile | bool | None:
        """The segment opened with its flock taken; None if the file is gone; False if another holder has it."""
        try:
            probe = SegmentFile(path, os.open(path, os.O_RDWR | os.O_CLOEXEC))
        except FileNotFoundError:
            return None
        if probe.try_lock():
            return probe
        probe.close()
        return False

    def trim_segment(self, seg_id: int) -> int:
        """Cut a sealed segment's uncommitted tail (bytes a crashed batch left past `tail`); returns bytes freed."""
        self._check_pid()
        probe = self._lock_segment(os.path.join(self._seg_dir, segment_name(seg_id)))
        if not isinstance(probe, SegmentFile):
            return 0
        try:
            with self.index.read() as txn:  # read under the flock: every batch that wrote this file has committed
                raw = txn.get(u64_key(seg_id), db=self.index.dbs["seg"])
            entry = SegmentEntry.unpack(raw) if raw is not None else None
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
        self._check_pid()
        if self.readonly:
            raise StoreReadOnly("relocate() needs a store opened for maintenance (not read-only)")
        if self._relocator is None:
            self._relocator = Appender(self.root, self.index, self.backend, self.config.segment_bytes)
        app = self._relocator
        failures: list[tuple[ObjectKey, QuarantineReason]] = []
        written: list[tuple[bytes, IndexEntry, int, int]] = []
        moved = 0
        with self._write_lock:
            app.begin_batch()
            synced = False
            try:
                with self.index.read() as txn:  # an epoch: the source segments cannot be unlinked while we copy
                    for key in keys:
                        raw_key = encode_key(key)
                        raw = txn.get(raw_key, db=self.index.dbs["obj"])
                        entry = _entry_or_none(raw) if raw is not None else None
                        if entry is None or entry.state is not RecordState.LIVE:
                            continue
                        try:
                            buf = self._fetch_checked(key, entry, self._segment(entry.segment))
                        except CorruptRecord as exc:
                            failures.append((key, exc.reason))
                            continue
                        try:
                            place = app.place(entry.record_len)
                            place.file.pwrite_all(buf.mv[: entry.record_len], place.offset)
                        finally:
                            self._buffers.release(buf)
                        written.append((raw_key, entry, place.seg_id, place.offset))
                if written:
                    app.sync_batch()
                    synced = True
                    moved = self.index.update(lambda txn: self._repoint(txn, written, app.batch_segments()))
            except BaseException:
                app.rewind(abandon=bool(written) and not synced)
                raise
            finally:
                app.end_batch()
        for key, why in failures:
            log.warning("quarantining %s: %s", _key_str(key), why.label)
            self.quarantine(key, why)
        return moved

    def _repoint(
        self, txn: lmdb.Transaction, written: list[tuple[bytes, IndexEntry, int, int]], segments: list[int]
    ) -> int:
        seg_db, obj_db = self.index.dbs["seg"], self.index.dbs["obj"]
        seg_entries = {s: SegmentEntry.unpack(txn.get(u64_key(s), db=seg_db)) for s in segments}
        moved = 0
        for raw_key, old, seg_id, offset in written:
            raw = txn.get(raw_key, db=obj_db)
            cur = _entry_or_none(raw) if raw is not None else None
            if (
                cur is None
                or cur.state is not RecordState.LIVE
                or (cur.segment, cur.offset, cur.seq) != (old.segment, old.offset, old.seq)
            ):
                continue
            txn.put(raw_key, dataclasses.replace(cur, segment=seg_id, offset=offset).pack(), db=obj_db)
            src = seg_entries.get(old.segment)
            if src is None and (src_raw := txn.get(u64_key(old.segment), db=seg_db)) is not None:
                src = SegmentEntry.unpack(src_raw)
            if src is not None:
                seg_entries[old.segment] = dataclasses.replace(
                    src,
                    referenced=max(0, src.referenced - old.record_len),
                    records=max(0, src.records - 1),
                    last_drop_txn=txn.id(),
                )
            dst = seg_entries[seg_id]
            seg_entries[seg_id] = dataclasses.replace(
                dst,
                tail=max(dst.tail, offset + old.record_len),
                referenced=dst.referenced + old.record_len,
                records=dst.records + 1,
            )
            moved += 1
        for seg_id, seg in seg_entries.items():
            txn.put(u64_key(seg_id), seg.pack(), db=seg_db)
        return moved

    def reader_check(self) -> int:
        """Clear dead readers from LMDB's table; close cached segment files that were unlinked."""
        self._check_pid()
        with self._files_lock:
            for seg_id in [s for s, f in self._files.items() if f.unlinked()]:
                self._files.pop(seg_id).close()
        return self.index.reader_check()

    def _publish_limits(self) -> None:
        doc = {"budget_bytes": self.config.budget_bytes, "form_quotas": {f.value: n for f, n in self._quotas.items()}}
        self.index.update(
            lambda txn: txn.put(b"limits", seal(json.dumps(doc, sort_keys=True).encode()), db=self.index.dbs["meta"])
        )

    def set_limits(self, budget_bytes: int, form_quotas: Mapping[CacheForm, int]) -> None:
        """Change the byte budget and per-form quotas (a reload) and publish them for the cleaner and `kvtier audit`."""
        self._check_pid()
        self.config = dataclasses.replace(
            self.config, budget_bytes=budget_bytes, form_quotas=StoreConfig.quotas(form_quotas)
        )
        self._quotas = dict(self.config.form_quotas)
        self._publish_limits()

    def limits(self) -> StoreLimits | None:
        """The limits the writer last published (None if no writer has yet)."""
        self._check_pid()
        with self.index.read() as txn:
            raw = txn.get(b"limits", db=self.index.dbs["meta"])
        if raw is None:
            return None
        doc = json.loads(unseal(raw))
        return StoreLimits(
            int(doc["budget_bytes"]), StoreConfig.quotas({CacheForm(f): int(n) for f, n in doc["form_quotas"].items()})
        )

    def meta_doc(self, name: str) -> dict[str, Any] | None:
        """A JSON document another process keeps in the index (`verifier`: the cleaner's progress and counters)."""
        self._check_pid()
        if name not in _META_DOCS:
            raise KeyError(name)
        with self.index.read() as txn:
            raw = txn.get(f"doc:{name}".encode(), db=self.index.dbs["meta"])
        return None if raw is None else json.loads(unseal(raw))

    def put_meta_doc(self, name: str, doc: Mapping[str, Any]) -> None:
        self._check_pid()
        if name not in _META_DOCS:
            raise KeyError(name)
        body = seal(json.dumps(doc, sort_keys=True).encode())
        self.index.update(lambda txn: txn.put(f"doc:{name}".encode(), body, db=self.index.dbs["meta"]))

    def stats(self) -> dict[str, Any]:
        """Records and bytes per form, achieved codec ratio, budget, segments, namespaces, backend."""
        self._check_pid()
        with self.index.read() as txn:
            usage = self.index.usage(txn)
            nseg = txn.stat(self.index.dbs["seg"])["entries"]
            ndirty = txn.stat(self.index.dbs["dirty"])["entries"]
            gone = self.index.dbs["gone"]
            ntomb = txn.stat(gone)["entries"] if gone is not None else 0
        namespaces = self.namespaces()
        forms = {
            f.value: {
                "records": u.records,
                "record_bytes": u.record_bytes,
                "payload_bytes": u.payload_bytes,
                "stored_bytes": u.stored_bytes,
                "codec_ratio": round(u.payload_bytes / u.stored_bytes, 3) if u.stored_bytes else None,
                "quota_bytes": self._quotas.get(f),
            }
            for f, u in usage.items()
        }
        return {
            "root": self.root,
            "io_backend": self.io_backend,
            "budget_bytes": self.config.budget_bytes or None,
            "record_bytes": sum(u.record_bytes for u in usage.values()),
            "records": sum(u.records for u in usage.values()),
            "forms": forms,
            "segments": nseg,
            "unverified": ndirty,
            "evicted_tombstones": ntomb,
            "namespaces": {
                "live": sum(n.live for n in namespaces.values()),
                "retired": sum(not n.live for n in namespaces.values()),
            },
        }

    # ----------------------------------------------------------------- housekeeping

    def _touch(self, raw_keys: list[bytes]) -> None:
        """Note access times in memory; flushed in one write txn every atime_flush_s (LRU is advisory)."""
        if self.readonly or not raw_keys:
            return
        now = time.time()
        with self._atime_lock:
            for k in raw_keys:
                self._atime[k] = now
            due = time.monotonic() - self._atime_flushed >= self.config.atime_flush_s or len(self._atime) >= 4096
        if due:
            self.flush_atimes()

    def flush_atimes(self) -> None:
        with self._atime_lock:
            pending, self._atime = self._atime, {}
            self._atime_flushed = time.monotonic()
        if not pending:
            return

        def put(txn: lmdb.Transaction) -> None:
            for k, t in pending.items():
                if txn.get(k, db=self.index.dbs["obj"]) is not None:
                    txn.put(k, pack_time(t), db=self.index.dbs["atime"])

        self.index.update(put)

    def _executor(self, role: str) -> ThreadPoolExecutor:
        """Separate read and write pools, so loads never queue behind a write that is growing the map."""
        pool = self._pools.get(role)
        if pool is None:
            pool = self._pools[role] = ThreadPoolExecutor(
                max(1, self.config.io_threads), thread_name_prefix=f"kvtier-store-{role}"
            )
        return pool

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise StoreForkError("this DiskStore was opened before fork(): open the store again in the child process")

    def close(self) -> None:
        """Flush access times, seal the segment being appended, release files, the index and the writer lock."""
        if os.getpid() != self._pid:
            return
        if not self.readonly:
            self.flush_atimes()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()
        for appender in (self._appender, self._relocator):
            if appender is not None:
                appender.close()
        self._appender = self._relocator = None
        with self._files_lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
        self.index.close()
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flat_uint8(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or not t.is_contiguous() or t.numel() == 0:
        raise StoreRequestError(
            "payloads and load targets must be non-empty contiguous uint8 tensors (a view of the slot)"
        )
    return t.view(-1)


def _is_live(raw: bytes) -> bool:
    entry = _entry_or_none(raw)
    return entry is not None and entry.state is RecordState.LIVE


def _entry_or_none(raw: bytes | memoryview) -> IndexEntry | None:
    try:
        return IndexEntry.unpack(raw)
    except CorruptRecord:
        return None


def _atime(raw: bytes | memoryview | None) -> float:
    try:
        return unpack_time(raw) if raw is not None else 0.0
    except CorruptRecord:
        return 0.0


def _check_header(h: RecordHeader, key: ObjectKey, e: IndexEntry) -> None:
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


def _key_str(key: ObjectKey) -> str:
    return f"{key.namespace.hex()}/{key.block_hash.hex()}/{key.group}/{key.form.value}"
