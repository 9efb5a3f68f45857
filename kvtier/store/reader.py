"""The read side: index lookups, segment files, checked reads of records into tensors."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import lmdb

from kvtier.core.forms import Reason
from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.core.tier import LoadRequest, MoreRequests, ObjectKey
from kvtier.store.aio_runs import BounceShare, RunRead, WaveRead
from kvtier.store.context import StoreContext, flat_uint8
from kvtier.store.devsum import device_checksum
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.extent import Run, Scatter, copy_out, plan_runs, scatter
from kvtier.store.header_check import AnyHeader, ExpectedHeaders, check_v1, fault, header_good
from kvtier.store.index import IndexEntry, RecordState, encode_key
from kvtier.store.io import AlignedBuffer, SegmentFile
from kvtier.store.packed import PackedLoad, take_buffers
from kvtier.store.record import (
    FORMAT_VERSION,
    HEADER_BYTES,
    LARGE_PAYLOAD,
    Codec,
    Flags,
    RecordHeader,
    zstd_decompress_into,
)
from kvtier.store.record_check import check_sums
from kvtier.store.record_v1 import V1_HEADER_BYTES
from kvtier.store.scan import PackedScan, ScanItem, ScanVisit
from kvtier.store.segments import segment_name
from kvtier.store.submit import Reads, close_reads, open_reads, run_gap

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

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
        # The read threads start with the store, not inside its first load: on a busy host eight thread starts
        # cost milliseconds, as much as a thousand small records take to read.
        ctx.executor("read")

    def take_load_resources(self) -> None:
        """Fault in the packed path's bounce buffers now (`packed.take_buffers`) and, where loads read through
        native AIO, set up a context: a daemon's first restore otherwise pays both."""
        close_reads(open_reads(self._ctx))
        take_buffers(self._ctx)

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
        """OK while the namespace is registered and live, else the miss every key of it gets."""
        try:
            ns = self._ctx.index.namespace(txn, namespace)
        except CorruptRecord:
            log.error(
                "namespace entry %s is corrupt: its records are misses until it is re-registered", namespace.hex()
            )
            return Reason.MISSING
        if ns is None:
            return Reason.MISSING
        return _OK if ns.live else Reason.STALE_VERSION

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
        """What `PackedLoad` serves through `reads` (and the faults it names), then the rest through the general
        path, each answer in its request's place."""
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
            general = LoadOutcome([], [], [])
            self._load(txn, [request(i) for i in rest], None, general)
            for i, reason in zip(rest, general.reasons):
                outcome.reasons[i] = reason
            outcome.hits += general.hits
            outcome.faults += general.faults

    def _load(
        self, txn: lmdb.Transaction, requests: Sequence[LoadRequest], more: MoreRequests | None, outcome: LoadOutcome
    ) -> None:
        """The general path: every request's lookup, read and checks a record at a time. It answers what the batch
        pipeline (`PackedLoad`) does not take: from the index alone why there is nothing to read (missing, evicted,
        quarantined, another layout or length, a corrupt index value, a retired namespace), and it reads the records
        of device targets (by GDS on a GDS store, else through the bounce buffer and a copy); a load of which the
        pipeline takes none of the first requests, some of them device targets, comes here whole, `more` included
        (`_load_packed`)."""
        reasons = outcome.reasons
        corrupt_values: list[ObjectKey] = []
        keys: list[ObjectKey] = []
        raw_keys: list[bytes] = []
        found: Iterator[tuple[int, tuple[tuple[Reason, IndexEntry | None], torch.Tensor]]] = iter(())

        def look(reqs: Sequence[LoadRequest]) -> None:
            """Queue the requests' lookups (run as `take` asks for them), answered after those queued before."""
            nonlocal found
            at = len(keys)
            reqs = list(reqs)  # (once: a LoadBatch builds its requests as they are asked for)
            new_keys = [req.key for req in reqs]
            new_raw = [encode_key(key) for key in new_keys]
            outs = [flat_uint8(req.out) for req in reqs]
            digests = [req.layout_digest for req in reqs]
            keys.extend(new_keys)
            raw_keys.extend(new_raw)
            reasons.extend([Reason.MISSING] * len(reqs))
            found = enumerate(zip(self.lookups(txn, new_keys, new_raw, digests, corrupt_values), outs), at)

        def take(upto: int) -> tuple[list[ReadJob], bool]:
            """The next keys' jobs, looked up until their records hold `upto` bytes; and whether keys are left."""
            jobs: list[ReadJob] = []
            nbytes = 0
            for i, ((reason, entry), out) in found:
                if entry is not None:
                    if entry.payload_len != out.numel():
                        reason = Reason.ABI_MISMATCH
                    else:
                        jobs.append(ReadJob(i, keys[i], entry, out, raw_keys[i]))
                        nbytes += entry.record_len
                reasons[i] = reason
                if nbytes >= upto and i + 1 < len(reasons):
                    return jobs, True
            return jobs, False

        look(requests)
        rest: Callable[[], Sequence[ReadJob]] | None
        if more is None:
            # The first keys' reads go out before the rest are looked up: the disk reads while this thread does.
            first, left = take(EARLY_READ_BYTES)
            rest = (lambda: take(_ALL)[0]) if left else None
        else:
            # The caller's first requests are read first (it sized them to cover what it does in `more`).
            first = take(_ALL)[0]

            def rest() -> Sequence[ReadJob]:
                look(more())
                return take(_ALL)[0]

        hits = outcome.hits
        for job, exc in self.read(first, _fill_out, more=rest):
            if exc is None:
                hits.append(raw_keys[job.index])
            else:
                outcome.faults.append((job.key, exc.reason))
                reasons[job.index] = exc.reason.miss_reason
        outcome.faults += [(key, QuarantineReason.INDEX_VALUE) for key in corrupt_values]

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

    def read(
        self,
        jobs: Sequence[ReadJob],
        visit: Visit,
        *,
        headers: bool = False,
        more: Callable[[], Sequence[ReadJob]] | None = None,
    ) -> list[tuple[ReadJob, CorruptRecord | None]]:
        """Read and check every job's record; `visit(job, header, buf, payload_at)` gets each good one while its
        bytes are in `buf`; buf is None where the payload went straight into `job.out` (a large record read
        into its target, or a GDS read). `header` is the parsed header with `headers=True`, else None where the
        record's header passed the header check (`header_check`). Runs of nearby records are one
        scattered read each, through the store's submit strategy (`submit`); GDS reads go to the read pool.
        `more`, if given, is called once for the rest of the jobs, once the first jobs' reads are on their way
        (on a GDS store first: the device jobs are chosen from all of them)."""
        backend = self._ctx.backend
        if more is not None and backend.gpu_direct:  # the device jobs are chosen from all of them
            jobs, more = [*jobs, *more()], None
        expect = ExpectedHeaders(jobs)
        device: list[ReadJob] = []
        if backend.gpu_direct:
            device = [j for j in jobs if j.out is not None and _gds_ready(j.entry) and backend.device_io(j.out)]
        if device:
            chosen = {id(j) for j in device}
            jobs = [j for j in jobs if id(j) not in chosen]
        # Device targets by GDS on the read pool; host targets through the submit strategy (`submit.open_reads`).
        on_device = self._ctx.executor("read").map(lambda j: self._read_device_job(j, visit, expect), device)
        reads = open_reads(self._ctx)
        gap = run_gap(reads)
        try:
            host = WaveRead(
                reads,
                _runs(jobs, gap),
                self._ctx.buffers,
                self._plan_run,
                _place,
                lambda rr, got, first, stop: self._check_run(rr, got, visit, headers, expect, first, stop),
                more=None if more is None else lambda: _runs(expect.add(more()), gap),
            ).run()
        finally:
            close_reads(reads)
        return [*host, *(r for rs in on_device for r in rs)]

    def _read_device_job(
        self, job: ReadJob, visit: Visit, expect: ExpectedHeaders
    ) -> list[tuple[ReadJob, CorruptRecord | None]]:
        try:
            self._read_device(job, expect)
            visit(job, None, None, 0)
            return [(job, None)]
        except CorruptRecord as exc:
            return [(job, exc)]

    def _plan_run(
        self, run: Run[ReadJob]
    ) -> tuple[Run[ReadJob], SegmentFile, Scatter] | list[tuple[ReadJob, CorruptRecord | None]]:
        """The run's segment and where its bytes go (`scatter`); or every job's fault when the segment is gone."""
        try:
            seg = self.segment(run.seg_id)
        except CorruptRecord as exc:
            return [(job, exc) for _, _, job in run.jobs]
        return (
            run,
            seg,
            scatter(
                run, [_NO_DIRECT if length < _LARGE_RECORD else self._direct_want(job) for _, length, job in run.jobs]
            ),
        )

    def _check_run(
        self,
        rr: RunRead[ReadJob],
        got: int,
        visit: Visit,
        headers: bool,
        expect: ExpectedHeaders,
        first: int = 0,
        stop: int | None = None,
    ) -> list[tuple[ReadJob, CorruptRecord | None]]:
        """Each record of a run read up to file offset `got` (of its jobs[first:stop]) checked on its own, its v2
        header against the one `expect` built for the load: one bad record fails alone, named by `fault`."""
        run, buf, base, plan = rr.run, rr.share.buf, rr.base, rr.plan
        mv = buf.mv
        results: list[tuple[ReadJob, CorruptRecord | None]] = []
        jobs, where_at, direct = run.jobs, plan.where, plan.direct
        if first or (stop is not None and stop < len(jobs)):  # part of the run (no copies for a whole one)
            jobs, where_at, direct = jobs[first:stop], where_at[first:stop], direct[first:stop]
        for (offset, length, job), where, took in zip(jobs, where_at, direct):
            e, at = job.entry, base + where
            try:
                if got < offset + length:
                    raise CorruptRecord(
                        QuarantineReason.SEGMENT_TRUNCATED, f"segment {run.seg_id:016x} ends inside the record"
                    )
                if e.record_version == FORMAT_VERSION:
                    if not header_good(mv, at, expect.of(job)):  # `fault` only names what is wrong
                        raise fault(e, job.key, mv, at)
                    payload_at = at + HEADER_BYTES
                    header: AnyHeader | None = RecordHeader.unpack(mv, at) if headers else None
                else:
                    payload_at = at + V1_HEADER_BYTES
                    header = check_v1(e, job.key, mv, at)
                if took:
                    _finish_direct(job, buf, payload_at, took)
                    visit(job, header, None, 0)
                else:
                    check_sums(e, mv[payload_at : payload_at + e.stored_len], buf.tensor, payload_at)
                    visit(job, header, buf, payload_at)
                results.append((job, None))
            except CorruptRecord as exc:
                results.append((job, exc))
        return results

    def _direct_want(self, job: ReadJob) -> tuple[int, int]:
        """(payload offset, bytes to read straight into `job.out`): the aligned bulk of a large, uncompressed
        v2 payload whose target is host memory at an address O_DIRECT takes; (0, 0) for the rest."""
        e, out = job.entry, job.out
        if e.payload_len < LARGE_PAYLOAD or out is None or e.codec is not _NONE:
            return _NO_DIRECT
        payload_at = e.payload_offset
        align = self._ctx.backend.direct_align
        if (
            e.record_version != FORMAT_VERSION
            or not out.is_cpu
            or payload_at % DISK_ALIGNMENT
            or out.data_ptr() % align
        ):
            return _NO_DIRECT
        return payload_at, e.payload_len - e.payload_len % align

    def _read_device(self, job: ReadJob, expect: ExpectedHeaders) -> None:
        """GDS: the header through a small host read, the payload straight into the device slot, checked there
        with the device checksum (never copied back to host). On a failed check the slot holds the bad bytes:
        the load reports the record corrupt and the caller must not use the slot."""
        entry, out = job.entry, job.out
        assert out is not None
        seg = self.segment(entry.segment)
        start = entry.offset - entry.offset % DISK_ALIGNMENT
        end = align_up(entry.payload_offset, DISK_ALIGNMENT)
        buf = self._ctx.buffers.acquire(end - start)
        try:
            if seg.pread_into(buf.mv[: end - start], start) < entry.payload_offset - start:
                raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the header")
            at = entry.offset - start
            if not header_good(buf.mv, at, expect.of(job)):
                raise fault(entry, job.key, buf.mv, at)
        finally:
            self._ctx.buffers.release(buf)
        if self._ctx.backend.read_device(seg, out, entry.payload_offset) < entry.payload_len:
            raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the payload")
        if device_checksum(out) != entry.device_checksum:
            raise CorruptRecord(QuarantineReason.PAYLOAD, "payload device checksum mismatch")

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


@dataclasses.dataclass(slots=True)
class ReadJob:
    """One record to read: the request's index, its key and entry, where its payload goes (None: nowhere), and its
    key as the index spells it where the caller has it (b"": encoded when needed). Slots, not a dict: one is made per
    object of every load the general path reads."""

    index: int
    key: ObjectKey
    entry: IndexEntry
    out: torch.Tensor | None
    raw_key: bytes = b""


def _place(run: Run[ReadJob], seg: SegmentFile, plan: Scatter, share: BounceShare, base: int) -> RunRead[ReadJob]:
    """The run's views: its bounce bytes from `base` of the share's buffer, its direct payloads in their targets."""
    mv = share.buf.mv
    views: list[memoryview] = []
    b = base
    for n, k in plan.pieces:
        if k < 0:
            views.append(mv[b : b + n])
            b += n
        else:
            views.append(_host_view(run.jobs[k][2].out, n))
    return RunRead(run, seg, plan, share, base, views)


# A load looks up keys until their records hold this many bytes and sends those reads before looking up the rest
# (a 32-object DSV4 batch: two or three objects first). A disk that starts on a read as it is submitted then reads
# while the other lookups run, instead of after them; how much is sent first matters little within a few MiB.
EARLY_READ_BYTES = 1 << 20
_ALL = 1 << 62
_NO_DIRECT = (0, 0)
_LARGE_RECORD = LARGE_PAYLOAD + HEADER_BYTES  # no shorter record has a payload `_direct_want` takes
_OK = Reason.OK
_QUARANTINED = RecordState.QUARANTINED
_NONE = Codec.NONE
_ZSTD = Codec.ZSTD
_memmove = ctypes.memmove
Visit = Callable[[ReadJob, "AnyHeader | None", "AlignedBuffer | None", int], None]


def _runs(jobs: Sequence[ReadJob], max_gap: int) -> list[Run[ReadJob]]:
    return plan_runs([(e.segment, e.offset, e.record_len, j) for j in jobs for e in (j.entry,)], max_gap)


def _gds_ready(entry: IndexEntry) -> bool:
    """A record a GDS read can check on the device: v2, stored as is, with a device checksum."""
    return entry.record_version == FORMAT_VERSION and entry.codec is Codec.NONE and bool(entry.flags & Flags.DEVSUM)


def _host_view(out: torch.Tensor | None, n: int) -> memoryview:
    """The first n bytes of a cpu target as a writable memoryview (a scattered read's destination)."""
    assert out is not None
    return out.numpy().data[:n]


def _finish_direct(job: ReadJob, buf: AlignedBuffer, tail_at: int, took: int) -> None:
    """A payload read straight into `job.out`: its unaligned tail (if any) from the bounce buffer, then its
    checksum over the target. On a mismatch the target holds the bad bytes (as after a GDS read): the load
    reports the record corrupt and the caller must not use the slot."""
    out, e = job.out, job.entry
    assert out is not None
    tail = e.payload_len - took
    if tail:
        ctypes.memmove(out.data_ptr() + took, buf.addr + tail_at, tail)
    check_sums(e, out.numpy().data, out, 0)


def _fill_out(job: ReadJob, header: AnyHeader | None, buf: AlignedBuffer | None, at: int) -> None:
    """A checked record's payload into the job's `out` (decoded first if it is stored compressed)."""
    out = job.out
    if out is None or buf is None:
        return
    entry = job.entry
    if entry.codec is _ZSTD:
        if out.is_cpu:
            zstd_decompress_into(buf.mv[at : at + entry.stored_len], out.numpy().data)
        else:
            import torch

            plain = torch.empty(entry.payload_len, dtype=torch.uint8)
            zstd_decompress_into(buf.mv[at : at + entry.stored_len], plain.numpy().data)
            out.copy_(plain)
    elif out.is_cpu:  # copy_out's cpu case, inline: this runs per object of every load
        _memmove(out.data_ptr(), buf.addr + at, entry.payload_len)
    else:
        copy_out(out, buf, at, entry.payload_len)
