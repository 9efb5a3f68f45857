"""Rebuild the index from segments alone, or (dry run) report what a rebuild would find: orphans, corruption."""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import shutil
import struct
import time
from collections.abc import Iterator

import lmdb

from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.store.devsum import device_checksum
from kvtier.store.errors import CorruptRecord, FormatVersionError, StoreError
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
from kvtier.store.ns_usage import recount
from kvtier.store.record import (
    FORM_CODES,
    HEADER_BYTES,
    MAGIC,
    RECORD_ALIGNMENT,
    Codec,
    Flags,
    RecordHeader,
    namespace_of,
    payload_checksum,
)
from kvtier.store.record_v1 import V1_HEADER_BYTES, V1_MAGIC, RecordHeaderV1
from kvtier.store.segments import SEGMENTS_DIR, WriterLock, fsync_dir, list_segments, segment_name

log = logging.getLogger(__name__)

_TXN_RECORDS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class ScannedRecord:
    """A complete record found in a segment: header good, payload checksum good."""

    seg_id: int
    offset: int
    header: RecordHeader | RecordHeaderV1

    @property
    def key(self) -> ObjectKey:
        h = self.header
        assert h.form is not None
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
    orphan_bytes: int = 0  # good object records on disk that no entry references
    unreferenced_bytes: int = 0  # every segment byte no entry references: orphans, namespace records, padding, junk
    missing_records: int = 0
    unattributed_records: int = 0  # good records whose namespace's version key survives nowhere
    records_after: int = 0
    namespaces_after: int = 0

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def scan_segment(
    path: str, seg_id: int, report: RebuildReport, versions: dict[bytes, bytes]
) -> Iterator[ScannedRecord]:
    """Walk one segment: a good header skips its record; anything else resyncs at the next magic (v2 headers
    start 32-aligned, v1 header blocks 4096-aligned). Namespace records found go into `versions` (ns -> JSON)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        report.segment_bytes += size
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            mv = memoryview(mm)
            try:
                offset = 0
                while (at := _next_magic(mm, offset)) >= 0:
                    try:
                        header = _header_at(mv, at)
                    except CorruptRecord:
                        header = None
                    if header is None or at + header.record_len > size:
                        report.corrupt_bytes += HEADER_BYTES
                        offset = at + 1
                        continue
                    offset = at + header.record_len
                    stored = mv[at + header.header_bytes : at + header.header_bytes + header.stored_len]
                    if not _payload_good(header, stored):
                        report.corrupt_extents += 1
                        report.corrupt_bytes += header.record_len
                    elif header.form is None:  # a namespace record: its version key, for the records after it
                        if namespace_of(bytes(stored)) == header.namespace:
                            versions[header.namespace] = bytes(stored)
                    elif isinstance(header, RecordHeaderV1) and header.version_key_namespace() != header.namespace:
                        report.corrupt_bytes += header.record_len
                    else:
                        if isinstance(header, RecordHeaderV1):
                            versions[header.namespace] = header.version_key
                        report.records_on_disk += 1
                        yield ScannedRecord(seg_id, at, header)
                    del stored
            finally:
                mv.release()


def _next_magic(mm: mmap.mmap, start: int) -> int:
    """The first offset >= start holding a v2 magic at a 32-byte step or a v1 magic at a 4096-byte step."""
    found = [
        i
        for i in (_find_aligned(mm, MAGIC, start, RECORD_ALIGNMENT), _find_aligned(mm, V1_MAGIC, start, 4096))
        if i >= 0
    ]
    return min(found) if found else -1


def _find_aligned(mm: mmap.mmap, magic: bytes, start: int, align: int) -> int:
    while (i := mm.find(magic, start)) >= 0 and i % align:
        start = i + 1
    return i


def _header_at(mv: memoryview, at: int) -> RecordHeader | RecordHeaderV1:
    if bytes(mv[at : at + 8]) == V1_MAGIC:
        return RecordHeaderV1.unpack(mv[at : at + V1_HEADER_BYTES])
    return RecordHeader.unpack(mv, at)


def _payload_good(header: RecordHeader | RecordHeaderV1, stored: memoryview) -> bool:
    if header.flags & Flags.XXH3:
        return payload_checksum(stored) == header.payload_checksum
    import torch

    return device_checksum(torch.frombuffer(bytearray(stored), dtype=torch.uint8)) == header.device_checksum


def _read_old_index(
    root: str,
) -> tuple[dict[bytes, IndexEntry], dict[bytes, NamespaceEntry], dict[bytes, float], int] | None:
    """The existing index's entries (corrupt values skipped), namespaces, atimes, next segment id.

    None if there is no index or it is unreadable."""
    if not os.path.isdir(os.path.join(root, INDEX_DIR)):
        return None
    try:
        old = Index(root, readonly=True)
    except FormatVersionError:
        raise  # a newer kvtier's index: refused, not rebuilt over (its segments may hold records we cannot read)
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
        versions: dict[bytes, bytes] = {}
        found: dict[bytes, ScannedRecord] = {}
        extents: dict[tuple[int, int], int] = {}  # every good object record on disk -> its length
        seg_ids = list_segments(seg_dir)
        sizes: dict[int, int] = {}
        for seg_id in seg_ids:
            path = os.path.join(seg_dir, segment_name(seg_id))
            before = report.segment_bytes
            for rec in scan_segment(path, seg_id, report, versions):
                extents[(seg_id, rec.offset)] = rec.header.record_len
                found[encode_key(rec.key)] = rec  # later segments / offsets win
            sizes[seg_id] = report.segment_bytes - before
        report.segments = len(seg_ids)
        known = set(versions) | (set(old[1]) if old is not None else set())
        for raw_key in [k for k, rec in found.items() if rec.header.namespace not in known]:
            del found[raw_key]  # no version key anywhere (its namespace record is damaged): not indexed
            report.unattributed_records += 1
        report.records_after = len(found)
        if old is not None:
            entries, _, _, _ = old
            report.indexed_records = len(entries)
            referenced = {(e.segment, e.offset): e.record_len for e in entries.values() if e.segment in sizes}
            report.referenced_bytes = sum(referenced.values())
            report.missing_records = sum(
                1 for e in entries.values() if e.state is RecordState.LIVE and (e.segment, e.offset) not in extents
            )
        else:
            referenced = {(r.seg_id, r.offset): r.header.record_len for r in found.values()}
            report.referenced_bytes = sum(referenced.values())
        orphans = [n for place, n in extents.items() if place not in referenced]
        report.orphan_records, report.orphan_bytes = len(orphans), sum(orphans)
        report.unreferenced_bytes = report.segment_bytes - report.referenced_bytes
        if not dry_run:
            report.namespaces_after = _write_index(root, found, sizes, old, versions)
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
    versions: dict[bytes, bytes],
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
            assert h.form is not None  # `found` holds object records: each names its form
            codecs.setdefault(h.namespace, {})[h.form.value] = "zstd"
        if h.namespace not in namespaces:
            namespaces[h.namespace] = NamespaceEntry(VersionKey.from_dict(json.loads(versions[h.namespace])), True, now)
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
                        record_version=h.record_version,
                        flags=int(h.flags),
                        device_checksum=h.device_checksum,
                    )
                    txn.put(raw_key, entry.pack(), db=index.obj)
                    txn.put(raw_key, pack_time(old_atimes.get(raw_key, h.created)), db=index.atime)

            index.update(put)
            for _, rec in chunk:
                h = rec.header
                assert h.form is not None
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
            recount(index, txn)  # last: its stamp covers the usage and sequence just written

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
