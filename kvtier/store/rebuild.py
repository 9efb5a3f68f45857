"""Rebuild the index from segments alone, or (dry run) report what a rebuild would find: orphans, corruption."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import struct
import time
from collections.abc import Iterator

import lmdb

from kvtier.core.tier import ObjectKey
from kvtier.store.errors import CorruptRecord, StoreError
from kvtier.store.index import (
    INDEX_DIR,
    TIME,
    FormUsage,
    Index,
    IndexEntry,
    NamespaceEntry,
    RecordState,
    SegmentEntry,
    encode_key,
    pack_time,
    u64_key,
)
from kvtier.store.io import BufferPool, select_backend
from kvtier.store.record import FORM_CODES, HEADER_BYTES, Codec, RecordHeader, payload_checksum
from kvtier.store.segments import SEGMENTS_DIR, WriterLock, fsync_dir, list_segments, segment_name

log = logging.getLogger(__name__)

_TXN_RECORDS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class ScannedRecord:
    """A complete record found in a segment: header good, payload checksum good."""

    seg_id: int
    offset: int
    header: RecordHeader

    @property
    def key(self) -> ObjectKey:
        h = self.header
        return ObjectKey(h.namespace, h.block_hash, h.group, h.form)


@dataclasses.dataclass(slots=True)
class RebuildReport:
    """What the segments hold against what the index says (bytes are record bytes on disk)."""

    dry_run: bool
    index_present: bool
    segments: int = 0
    segment_bytes: int = 0
    records_on_disk: int = 0
    corrupt_extents: int = 0
    corrupt_bytes: int = 0
    indexed_records: int = 0
    referenced_bytes: int = 0
    orphan_records: int = 0
    orphan_bytes: int = 0
    missing_records: int = 0
    records_after: int = 0
    namespaces_after: int = 0

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def scan_segment(path: str, seg_id: int, pool: BufferPool, report: RebuildReport) -> Iterator[ScannedRecord]:
    """Walk one segment at 4096-B steps: a good header skips its record; anything else resyncs at the next block."""
    backend = select_backend(os.path.dirname(path), "auto", readonly=True)
    seg = backend.open(path)
    try:
        size = seg.size()
        report.segment_bytes += size
        offset = 0
        while offset + HEADER_BYTES <= size:
            buf = pool.acquire(HEADER_BYTES)
            try:
                seg.pread_into(buf.mv[:HEADER_BYTES], offset)
                header = RecordHeader.unpack(buf.mv[:HEADER_BYTES])
            except CorruptRecord:
                header = None
            finally:
                pool.release(buf)
            if (
                header is None
                or offset + header.record_len > size
                or header.version_key_namespace() != header.namespace
            ):
                report.corrupt_bytes += HEADER_BYTES if header is None else 0
                offset += HEADER_BYTES
                continue
            buf = pool.acquire(header.record_len)
            try:
                seg.pread_into(buf.mv[: header.record_len], offset)
                good = (
                    payload_checksum(buf.mv[HEADER_BYTES : HEADER_BYTES + header.stored_len]) == header.payload_checksum
                )
            finally:
                pool.release(buf)
            if good:
                report.records_on_disk += 1
                yield ScannedRecord(seg_id, offset, header)
            else:
                report.corrupt_extents += 1
                report.corrupt_bytes += header.record_len
            offset += header.record_len
        report.corrupt_bytes += size - offset if size > offset else 0
    finally:
        seg.close()


def _read_old_index(
    root: str,
) -> tuple[dict[bytes, IndexEntry], dict[bytes, NamespaceEntry], dict[bytes, float], int] | None:
    """The existing index's entries (corrupt values skipped), namespaces, atimes, next segment id.

    None if there is no index or it is unreadable."""
    if not os.path.isdir(os.path.join(root, INDEX_DIR)):
        return None
    try:
        old = Index(root, readonly=True)
    except (StoreError, lmdb.Error) as exc:
        log.warning("existing index is unreadable (%s): rebuilding from segments alone", exc)
        return None
    entries: dict[bytes, IndexEntry] = {}
    namespaces: dict[bytes, NamespaceEntry] = {}
    atimes: dict[bytes, float] = {}
    try:
        with old.read() as txn:
            for k, v in txn.cursor(db=old.obj):
                try:
                    entries[bytes(k)] = IndexEntry.unpack(v)
                except CorruptRecord:
                    continue
            for k, v in txn.cursor(db=old.ns):
                try:
                    namespaces[bytes(k)] = NamespaceEntry.unpack(v)
                except CorruptRecord:
                    continue
            for k, v in txn.cursor(db=old.atime):
                try:
                    atimes[bytes(k)] = TIME.unpack(v[: TIME.size])[0]
                except struct.error:
                    continue
            next_segment = old.get_meta_u64(txn, b"next_segment", 1)
    finally:
        old.close()
    return entries, namespaces, atimes, next_segment


def rebuild_index(root: str, *, dry_run: bool = False) -> RebuildReport:
    """Scan every segment; dry run: report orphans and corruption; else write a fresh index.lmdb from them."""
    root = os.path.abspath(root)
    seg_dir = os.path.join(root, SEGMENTS_DIR)
    if not os.path.isdir(seg_dir):
        raise StoreError(f"{root} has no {SEGMENTS_DIR}/ directory: is it a kvtier store?")
    lock = None if dry_run else WriterLock(root)
    try:
        old = _read_old_index(root)
        report = RebuildReport(dry_run=dry_run, index_present=old is not None)
        pool = BufferPool(64 << 20)
        found: dict[bytes, ScannedRecord] = {}
        extents: set[tuple[int, int]] = set()
        seg_ids = list_segments(seg_dir)
        sizes: dict[int, int] = {}
        for seg_id in seg_ids:
            path = os.path.join(seg_dir, segment_name(seg_id))
            before = report.segment_bytes
            for rec in scan_segment(path, seg_id, pool, report):
                extents.add((seg_id, rec.offset))
                found[encode_key(rec.key)] = rec  # later segments / offsets win
            sizes[seg_id] = report.segment_bytes - before
        report.segments = len(seg_ids)
        report.records_after = len(found)
        if old is not None:
            entries, _, _, _ = old
            report.indexed_records = len(entries)
            referenced = {(e.segment, e.offset): e.record_len for e in entries.values() if e.segment in sizes}
            report.referenced_bytes = sum(referenced.values())
            report.missing_records = sum(
                1 for e in entries.values() if e.state is RecordState.LIVE and (e.segment, e.offset) not in extents
            )
            report.orphan_records = len(extents - set(referenced))
        else:
            report.referenced_bytes = sum(r.header.record_len for r in found.values())
            report.orphan_records = report.records_on_disk - len(found)
        report.orphan_bytes = report.segment_bytes - report.referenced_bytes
        if not dry_run:
            report.namespaces_after = _write_index(root, found, sizes, old)
        else:  # what the real run would write: the old index's namespaces and every one a record names
            known = set(old[1]) if old is not None else set()
            report.namespaces_after = len(known | {r.header.namespace for r in found.values()})
        return report
    finally:
        if lock is not None:
            lock.release()


def _write_index(
    root: str,
    found: dict[bytes, ScannedRecord],
    sizes: dict[int, int],
    old: tuple[dict[bytes, IndexEntry], dict[bytes, NamespaceEntry], dict[bytes, float], int] | None,
) -> int:
    """Write the new index next to the old one, then swap directories. Returns the namespace count."""
    old_entries, old_ns, old_atimes, old_next = old if old is not None else ({}, {}, {}, 1)
    tmp_name = f"{INDEX_DIR}.rebuild"
    tmp = os.path.join(root, tmp_name)
    shutil.rmtree(tmp, ignore_errors=True)
    index = Index(root, dirname=tmp_name)
    now = time.time()
    namespaces = dict(old_ns)
    codecs: dict[bytes, dict[str, str]] = {}
    for rec in found.values():
        h = rec.header
        if h.codec is Codec.ZSTD:
            codecs.setdefault(h.namespace, {})[h.form.value] = "zstd"
        if h.namespace not in namespaces:
            namespaces[h.namespace] = NamespaceEntry(h.parsed_version_key(), True, now)
    for ns, forms in codecs.items():
        if ns not in old_ns:
            namespaces[ns] = dataclasses.replace(namespaces[ns], codecs=tuple(sorted(forms.items())))
    usage = {f: FormUsage() for f in FORM_CODES}
    segs = {s: SegmentEntry(sealed=True, created=now, tail=n) for s, n in sizes.items()}
    items = sorted(found.items(), key=lambda kv: (kv[1].seg_id, kv[1].offset))
    try:
        for start in range(0, len(items), _TXN_RECORDS):
            chunk = items[start : start + _TXN_RECORDS]

            def put(txn: lmdb.Transaction, chunk=chunk, start=start) -> None:
                for i, (raw_key, rec) in enumerate(chunk):
                    h = rec.header
                    prev = old_entries.get(raw_key)
                    pin = prev.pin_until if prev is not None else 0.0
                    entry = IndexEntry(
                        RecordState.LIVE,
                        h.form,
                        h.codec,
                        rec.seg_id,
                        rec.offset,
                        h.record_len,
                        h.payload_len,
                        h.stored_len,
                        h.payload_checksum,
                        h.layout_digest,
                        start + i + 1,
                        h.created,
                        now,
                        pin,
                    )
                    txn.put(raw_key, entry.pack(), db=index.obj)
                    txn.put(raw_key, pack_time(old_atimes.get(raw_key, h.created)), db=index.atime)

            index.update(put)
            for _, rec in chunk:
                h = rec.header
                usage[h.form].add(h.record_len, h.payload_len, h.stored_len, +1)
                seg = segs[rec.seg_id]
                segs[rec.seg_id] = dataclasses.replace(
                    seg, referenced=seg.referenced + rec.header.record_len, records=seg.records + 1
                )

        def finish(txn: lmdb.Transaction) -> None:
            for ns, entry in namespaces.items():
                txn.put(ns, entry.pack(), db=index.ns)
            for seg_id, seg in segs.items():
                txn.put(u64_key(seg_id), seg.pack(), db=index.seg)
            index.put_usage(txn, usage)
            index.put_meta_u64(txn, b"seq", len(items) + 1)
            index.put_meta_u64(txn, b"next_segment", max([old_next, *(s + 1 for s in sizes)]))

        index.update(finish)
    finally:
        index.close()
    live = os.path.join(root, INDEX_DIR)
    retired = os.path.join(root, f"{INDEX_DIR}.old-{os.getpid()}")
    if os.path.isdir(live):
        os.rename(live, retired)
    os.rename(tmp, live)
    fsync_dir(root)
    shutil.rmtree(retired, ignore_errors=True)
    log.info("rebuilt %s: %d records, %d namespaces", live, len(items), len(namespaces))
    return len(namespaces)
