"""A load's records looked up, read and checked as arrays: numpy per batch, not Python steps per record.

Contract (`PackedLoad(ctx, txn, reads, segment, namespace_reason)`, one load, one thread):
- `add(requests, first)` takes the load's requests numbered from `first`, keeps those this path serves and submits their
  reads through `reads` (a submit strategy, `kvtier.store.submit`: native AIO or the read pool's threads); it returns
  the numbers of the others. It serves a request whose record is live in a live namespace, with the request's layout
  digest and payload length. A target that is host memory the columns take (a cpu tensor a GDS backend does not claim):
  a v2 record stored as is or zstd-compressed with an xxh3 checksum goes through the columnar checks; a v1 record, a v2
  record with only a device checksum, or a large payload that does not start 4096-aligned is taken too and checked on
  its own (`record_check`). A large v2 payload whose target is at an address O_DIRECT takes is read straight into it
  (the bytes move once), in pieces of PIECE_BYTES, its unaligned tail through the bounce buffer; any other is read into
  the bounce buffer and copied once checked. Any other target (device memory) is a row checked on its own: a record a
  GDS read checks on the device (`device_rows.gds_ready`) with a target the backend reads directly has a run that reads
  its header only, its payload then read by the backend's device read on the read pool and checked with the device
  checksum (`device_rows.read_device`); any other is read whole into the bounce buffer and copied (or decoded) into the
  target once checked. A target that is not a non-empty contiguous uint8 tensor raises StoreRequestError before anything
  is read. From a `LoadBatch` it reads the columns (keys encoded from them, targets as pool addresses) and builds a
  request only for an object it does not serve.
- `finish()` waits for every read, checks every record (not cut short, its header by `header_check.headers_good`, the
  payload's xxh3_128: a large one's over its target, after its tail is copied there) and copies each good small one into
  its target (a compressed one decoded into it). A record the columnar check does not accept is checked again on its
  own, on the bytes already read (`record_check.check_record`): served if good, else named; a device row's payload read
  and device checksum are waited for. Returns the encoded keys of those it served and the faults, (request number,
  CorruptRecord naming the quarantine reason), a segment that cannot be opened among them. A large record that fails
  leaves its target holding the bytes read: the caller must not use a slot whose load was not `ok`.
- What it does not take (no record, not live, another layout or length, a corrupt index value, a retired namespace, an
  uncompressed entry whose stored length is not its payload's) is the caller's to answer (`Reader`, which names why
  from the index).
- `close()` (always, also after an exception) waits out every read in flight (a device row's too) and gives the bounce
  buffers back.

Why: a load of small records costs Python steps per record, not disk time: per batch in numpy, the lookups, planning,
submission, checks and copies of random small records take a fraction of the thread's CPU per record that stepping
through them does (bench/store.py's small loads measure the objects/s). Runs hold records up to AIO_RUN_GAP apart, cut
where a file offset crosses a multiple of CHUNK_BYTES so no read is longer, and read CHUNK_BYTES at a time with at most
IN_FLIGHT chunks out: a disk that returns what it holds together (as virtual disks do) reads the next chunk while this
thread checks the last. (A scan, background work, reads one chunk of `extent.BACKGROUND_IO_BYTES` at a time.) A load
holds at most IN_FLIGHT + 1 chunks' bounce buffers (those read and the one checked) and
those of the chunks that read into their targets sent within WINDOW_BYTES (each smaller than its reads), however many
records it asks for. A run ends with each large record (its read is bounce bytes, the payload's aligned bulk into the
target, the tail into the bounce buffer), cut where its bytes cross a multiple of PIECE_BYTES. A chunk that reads into
its targets holds few bounce bytes, so past the IN_FLIGHT chunks more of them go while their reads fit in WINDOW_BYTES
(and the AIO queue has room): a load of large records keeps the disk's queue as deep as fio's reads at that request size
and depth (`bench/fio_limit.py`, `bench/store.py`), and each record is checked (its xxh3 over its target) as soon as its
chunk is in, while the disk reads the chunks after it. Past the IN_FLIGHT chunks no more than half of the load's bytes
go at once: a load smaller than twice the window (a restore's batch of blocks) is read in two waves at least, so that on
a disk that returns a batch of reads together (bench/peers.py's batches on a virtual disk) its first wave is checked
while the second is read. This is the one read path: every record a load or a scan reads is
read and checked here, and a request it does not take has nothing to read (the caller names why from the index).
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

import lmdb
import numpy as np
import xxhash

from kvtier.core.forms import Reason
from kvtier.core.layout import DISK_ALIGNMENT
from kvtier.core.loadbatch import LoadBatch
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import aio
from kvtier.store.aio import AIO_PIECE_BYTES, AIO_WINDOW_BYTES
from kvtier.store.context import StoreContext, flat_uint8
from kvtier.store.device_rows import fill_device, gds_ready, read_device
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.extent import AIO_RUN_GAP
from kvtier.store.header_check import expected_headers, fault, headers_good
from kvtier.store.index import ENTRY_V2_DTYPE, IndexEntry, RecordState, decode_key, encode_key, sealed_rows
from kvtier.store.io import AlignedBuffer, SegmentFile
from kvtier.store.record import (
    FORMAT_VERSION,
    HEADER_BYTES,
    LARGE_PAYLOAD,
    RECORD_ALIGNMENT,
    Codec,
    Flags,
    payload_checksum,
    zstd_decompress_into,
)
from kvtier.store.record_check import check_record, entry_rows
from kvtier.store.submit import Reads, cut_pieces, with_target
from kvtier.store.wanted import Wanted, batch_wanted, servable
from kvtier.store.wanted import wanted as want

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

CHUNK_BYTES = 4 << 20  # bytes of runs read per chunk; no run crosses a multiple of it in its file
IN_FLIGHT = 2  # chunks read at once
EARLY_KEYS = 128  # a load's first keys are looked up and their reads sent before the rest are looked up
RUN_GAP = AIO_RUN_GAP  # records at most this far apart are read together
# A large payload's read is cut into pieces of this size (the request size fio is held to, `bench/fio_limit.py`), and
# chunks that read into their targets are sent while fewer than WINDOW_BYTES are in flight (its queue depth).
PIECE_BYTES = AIO_PIECE_BYTES
WINDOW_BYTES = AIO_WINDOW_BYTES

_h128 = xxhash.xxh3_128_digest
_memmove = ctypes.memmove


@dataclasses.dataclass(slots=True)
class Chunk:
    """Runs read into one bounce buffer (`buf`, taken when submitted). Per run: its file, where it starts there and
    in the buffer, its bytes in the buffer, the bytes read (-1 while in flight), and where its last record is
    large, where its payload starts in the run, its target's address and the payload's bulk read straight into it.
    Per record, in file order: its request number, encoded key, target address, where it starts in the buffer, the
    bytes its run must read to hold it, its run, the bytes of its payload read into its target (0: small), the
    header its key and index entry imply, its payload length and checksum, its stored length and whether it is stored
    compressed."""

    files: list[SegmentFile]
    starts: list[int]
    bases: list[int]
    sizes: list[int]
    direct: list[tuple[int, int, int] | None]
    numbers: list[int]
    keys: list[bytes]
    targets: list[int]
    at: np.ndarray
    need: np.ndarray
    run_of: np.ndarray
    bulk: np.ndarray
    expected: np.ndarray
    payload_len: list[int]
    payload_checksum: np.ndarray
    stored_len: list[int]
    zstd: np.ndarray
    odd: np.ndarray  # checked one by one (`record_check`): a v1 record, a device checksum only, a failed fast check
    reads: int = 0  # bytes the chunk's reads ask for (bounce and bulk)
    buf: AlignedBuffer | None = None
    got: list[int] = dataclasses.field(default_factory=list)
    left: int = 0


class PackedLoad:
    """One load's packed path (the module docstring states the contract)."""

    chunk_bytes = CHUNK_BYTES  # a scan, background work, reads smaller chunks one at a time (`scan.PackedScan`)
    in_flight = IN_FLIGHT

    def __init__(
        self,
        ctx: StoreContext,
        txn: lmdb.Transaction,
        reads: Reads,
        segment: Callable[[int], SegmentFile],
        namespace_reason: Callable[[lmdb.Transaction, bytes], Reason],
    ) -> None:
        self._ctx, self._txn, self._reads = ctx, txn, reads
        self._segment, self._namespace_reason = segment, namespace_reason
        self._ns_ok: dict[bytes, bool] = {}
        self._waiting: deque[Chunk] = deque()  # planned, not yet submitted
        self._load_bytes = 0  # what the chunks planned so far read: at most half of it in flight past IN_FLIGHT chunks
        self._reading: deque[Chunk] = deque()
        self._hits: list[bytes] = []
        self._faults: list[tuple[int, CorruptRecord]] = []
        # Per request number, a target the columns do not take (device memory) and whether GDS reads its payload
        self._devices: dict[int, tuple[torch.Tensor, bool]] = {}
        self._device_reads: list[tuple[int, bytes, Future[None]]] = []  # GDS reads on the read pool

    def add(self, requests: Sequence[LoadRequest], first: int) -> list[int]:
        backend = self._ctx.backend
        # A GDS store reads device targets' payloads with GDS (`_plan_devices`): the backend says which targets are its
        device = backend.device_io if backend.gpu_direct else None
        if isinstance(requests, LoadBatch):
            wanted, rest = batch_wanted(requests, first, device)
            if rest:  # objects its columns do not describe as host memory: their requests, taken as a list's are
                built, left = want([requests[i - first] for i in rest], 0, device)
                built.numbers = [rest[j] for j in built.numbers]
                wanted, rest = wanted.joined(built), [rest[j] for j in left]
        else:
            wanted, rest = want(requests, first, device)
        rest = self._plan_devices(requests, first, rest)
        for part in (wanted.part(0, EARLY_KEYS), wanted.part(EARLY_KEYS, len(wanted.numbers))):
            if part.numbers:
                rest += self._plan(part)
                self._submit()
        return rest

    def finish(self) -> tuple[list[bytes], list[tuple[int, CorruptRecord]]]:
        while self._reading:
            self._wait_oldest()
            chunk = self._reading.popleft()
            try:
                self._submit()  # the disk reads the next chunk while this one is checked
            except BaseException:
                self._reading.appendleft(chunk)  # close() gives its buffer back
                raise
            self._check(chunk)
        for number, raw_key, done in self._device_reads:
            try:
                done.result()
                self._hits.append(raw_key)
            except CorruptRecord as exc:
                self._faults.append((number, exc))
        self._device_reads.clear()
        return self._hits, self._faults

    def close(self) -> None:
        wait([done for _, _, done in self._device_reads])
        self._device_reads.clear()
        self._reads.drain()
        for chunk in self._reading:
            assert chunk.buf is not None
            self._ctx.buffers.release(chunk.buf)
        self._reading.clear()
        self._waiting.clear()

    # ----------------------------------------------------------------- planning

    def _plan(self, w: Wanted) -> list[int]:
        """Look the requests up and queue the chunks of those this path serves; the numbers of the others."""
        txn = self._txn
        raw = w.raw
        pairs = txn.cursor(db=self._ctx.index.obj).getmulti(raw)
        if len(pairs) == len(raw):  # every key found (getmulti answers in the order asked, skipping the absent)
            values = [v for _, v in pairs]
        else:
            found = dict(pairs)
            values = [found.get(k, b"") for k in raw]
        ns_ok = self._ns_ok
        namespaces = set(w.namespaces)
        for ns in namespaces - ns_ok.keys():
            ns_ok[ns] = self._namespace_reason(txn, ns) is Reason.OK
        count = len(values)
        shaped_at = np.fromiter(map(len, values), np.int64, count) == ENTRY_V2_DTYPE.itemsize
        if not all(map(ns_ok.__getitem__, namespaces)):
            shaped_at &= np.fromiter(map(ns_ok.__getitem__, w.namespaces), bool, count)
        shaped = np.flatnonzero(shaped_at)
        at = shaped.tolist()
        e, sealed = sealed_rows([values[i] for i in at], ENTRY_V2_DTYPE)
        lengths = w.lengths[shaped]
        digests = [w.digests[i] for i in at]
        ok = (
            sealed
            & (e["version"] == FORMAT_VERSION)
            & (e["state"] == _LIVE)
            # stored as is, or compressed (decoded from the bounce buffer into the target once its checksum passes)
            & (((e["codec"] == _PLAIN) & (e["stored_len"] == lengths)) | (e["codec"] == _ZSTD))
            & ((e["flags"] & _XXH3) != 0)
            & (e["payload_len"] == lengths)
            & (e["record_len"] == e["stored_len"] + HEADER_BYTES)
            # a large payload starts 4096-aligned (`record.header_offset`): its bulk is read straight into the target
            & ((e["stored_len"] < LARGE_PAYLOAD) | ((e["offset"] + HEADER_BYTES) % DISK_ALIGNMENT == 0))
        )
        if set(map(len, digests)) == {16}:  # (another length never matches: the caller says so)
            ok &= np.frombuffer(b"".join(digests), "V16") == e["layout_digest"]
        else:
            ok[:] = False
        ours = shaped[ok]
        left = np.ones(count, bool)
        left[ours] = False
        odd, odd_rows = self._odd(values, w, np.flatnonzero(left).tolist())
        rows = np.concatenate((e[ok], odd_rows)) if odd else e[ok]
        self._queue(rows, w, ours.tolist() + odd, np.arange(len(rows)) >= len(ours))
        left[odd] = False
        return [w.numbers[i] for i in np.flatnonzero(left).tolist()]

    def _odd(self, values: Sequence[bytes | memoryview], w: Wanted, left: list[int]) -> tuple[list[int], np.ndarray]:
        """Those of the requests `left` (the columnar rules above leave them out) whose record a load still serves,
        checked one by one where their chunk is read (`record_check`): a v1 record, one that carries only a device
        checksum, a large one whose payload does not start where O_DIRECT can read it into a target. Those with no
        record, a record another request or a lookup answers for (not live, another layout or length, a corrupt index
        value, a retired namespace) are left to the caller, which names why without reading."""
        ns_ok = self._ns_ok
        picked: list[int] = []
        entries: list[IndexEntry] = []
        for i in left:
            entry = servable(values[i], ns_ok[w.namespaces[i]], w.digests[i], int(w.lengths[i]))
            if entry is not None:
                picked.append(i)
                entries.append(entry)
        return picked, entry_rows(entries)

    def _plan_devices(self, requests: Sequence[LoadRequest], first: int, numbers: list[int]) -> list[int]:
        """Look up the requests `numbers` (from `first`) whose target the columns do not take (device memory) and queue
        the rows of those whose record this load serves, checked one by one (`_one`): a record the backend reads into
        its target by GDS (`device_rows.gds_ready`) has a run that reads its header only. The numbers of the others."""
        backend, txn, obj, ns_ok = self._ctx.backend, self._txn, self._ctx.index.obj, self._ns_ok
        left: list[int] = []
        entries: list[IndexEntry] = []
        lengths: list[int] = []
        w = Wanted([], [], [], [], np.zeros(0, np.uint64), [])
        for n in numbers:
            req = requests[n - first]
            out, raw, ns = flat_uint8(req.out), encode_key(req.key), req.key.namespace
            if ns not in ns_ok:
                ns_ok[ns] = self._namespace_reason(txn, ns) is Reason.OK
            entry = servable(txn.get(raw, db=obj), ns_ok[ns], req.layout_digest, out.numel())
            if entry is None:
                left.append(n)
                continue
            self._devices[n] = (out, backend.gpu_direct and backend.device_io(out) and gds_ready(entry))
            w.numbers.append(n)
            w.raw.append(raw)
            w.namespaces.append(ns)
            w.targets.append(0)  # (no host address: `_one` moves its bytes)
            w.digests.append(req.layout_digest)
            lengths.append(out.numel())
            entries.append(entry)
        if entries:
            w.lengths = np.asarray(lengths, np.uint64)
            rows = entry_rows(entries)
            # A GDS row's run reads its header only: as far as the run is concerned, the record ends there.
            rows["record_len"][np.array([self._devices[n][1] for n in w.numbers], bool)] = HEADER_BYTES
            self._queue(rows, w, list(range(len(entries))), np.ones(len(entries), bool))
            self._submit()
        return left

    def _queue(self, e: np.ndarray, w: Wanted, ours: list[int], odd: np.ndarray) -> None:
        """Plan the runs and chunks (file order) of the records `e`, those of `w`'s requests `ours` (`odd`: those
        checked one by one); a record whose segment is gone is a fault, named as opening it names it."""
        files: dict[int, SegmentFile | None] = {}
        gone: dict[int, CorruptRecord] = {}
        for seg_id in set(e["segment"].tolist()):  # (not np.unique: its first call imports numpy.ma)
            try:
                files[seg_id] = self._segment(seg_id)
            except CorruptRecord as exc:
                files[seg_id] = None
                gone[seg_id] = exc
        pick = np.asarray(ours, np.int64)
        if None in files.values():
            here = np.fromiter((files[s] is not None for s in e["segment"].tolist()), bool, len(e))
            self._faults += [
                (w.numbers[i], gone[s]) for i, s in zip(pick[~here].tolist(), e["segment"][~here].tolist())
            ]
            e, pick, odd = e[here], pick[here], odd[here]
        if not len(e):
            return
        order = np.lexsort((e["offset"], e["segment"]))
        e, odd = e[order], odd[order]
        o = pick[order].tolist()  # (one pass over the lists: the requests of `e`'s records, in file order)
        raw, targets, numbers = [w.raw[i] for i in o], [w.targets[i] for i in o], [w.numbers[i] for i in o]
        seg = e["segment"]
        off = e["offset"].astype(np.int64)
        end = off + e["record_len"].astype(np.int64)
        plen = e["payload_len"].astype(np.int64)
        align = self._ctx.backend.direct_align
        zstd = e["codec"] == _ZSTD
        # Bytes read straight into the target: a large payload's aligned bulk where the target is at an address
        # O_DIRECT takes (else the payload goes through the bounce buffer, as a compressed one does: it is decoded).
        # (a target address of 0 is no target: a scan's records are visited in the bounce buffer, `scan.PackedScan`)
        target_at = np.asarray(targets, np.int64)
        direct_ok = (target_at % align == 0) & (target_at != 0) & ~odd
        bulk = np.where((plen >= LARGE_PAYLOAD) & ~zstd & direct_ok, plen - plen % align, 0)
        # Records never share bytes (the same one asked twice aside), so the one before ends the run so far; a large
        # record ends its run (its payload's bulk is the run's one read into a target). A record asked again starts a
        # run of its own: the copy before it may have its payload's bulk read into its target, not the bounce buffer.
        breaks = np.ones(len(e), bool)
        breaks[1:] = (
            (seg[1:] != seg[:-1])
            | (off[1:] - end[:-1] > RUN_GAP)
            | (off[1:] // self.chunk_bytes != off[:-1] // self.chunk_bytes)
            | (bulk[:-1] > 0)
            | (off[1:] < end[:-1])
        )
        first = np.flatnonzero(breaks)
        run_of = np.cumsum(breaks) - 1
        last = np.append(first[1:], len(e)) - 1
        run_start = off[first] & -DISK_ALIGNMENT
        run_end = -(-np.maximum.reduceat(end, first) // DISK_ALIGNMENT) * DISK_ALIGNMENT
        run_size = run_end - run_start
        run_bulk = bulk[last]
        run_bounce = run_size - run_bulk
        payload_at = off[last] + HEADER_BYTES - run_start  # where the last record's payload starts in the run
        direct: list[tuple[int, int, int] | None] = [None] * len(first)
        for r in np.flatnonzero(run_bulk).tolist():
            direct[r] = (int(payload_at[r]), targets[int(last[r])], int(run_bulk[r]))
        expected = expected_headers(e, raw)
        # Chunks: consecutive runs up to CHUNK_BYTES of file (at least one) and a share of the AIO queue: the most
        # runs from `lo` whose bytes fit, found in the running sum (runs are never empty: it only grows).
        runs_total = np.concatenate(([0], np.cumsum(run_size))).tolist()
        lo, count = 0, len(first)
        while lo < count:
            fit = bisect.bisect_right(runs_total, runs_total[lo] + self.chunk_bytes, lo) - 1
            hi = max(lo + 1, min(fit, lo + _RUNS_PER_CHUNK))
            total = runs_total[hi] - runs_total[lo]
            r0, r1 = int(first[lo]), int(first[hi]) if hi < count else len(e)
            bases = np.concatenate(([0], np.cumsum(run_bounce[lo:hi])[:-1]))
            runs = run_of[r0:r1] - lo
            self._load_bytes += total
            self._waiting.append(
                Chunk(
                    [files[s] for s in seg[first[lo:hi]].tolist()],  # type: ignore[misc]
                    run_start[lo:hi].tolist(),
                    bases.tolist(),
                    run_bounce[lo:hi].tolist(),
                    direct[lo:hi],
                    numbers[r0:r1],
                    raw[r0:r1],
                    targets[r0:r1],
                    # (a large record's header and tail lie in the buffer as they would without its bulk: it is last)
                    bases[runs] + (off[r0:r1] - run_start[lo:hi][runs]),
                    end[r0:r1] - run_start[lo:hi][runs],
                    runs,
                    bulk[r0:r1],
                    expected[r0:r1],
                    e["payload_len"][r0:r1].tolist(),
                    e["payload_checksum"][r0:r1],
                    e["stored_len"][r0:r1].tolist(),
                    zstd[r0:r1],
                    odd[r0:r1],
                    total,
                )
            )
            lo = hi

    # ----------------------------------------------------------------- reading and checking

    def _submit(self) -> None:
        """Send the next chunks' reads while fewer than IN_FLIGHT are out, or (a chunk that reads into its targets)
        while its reads fit in the window and the queue, and in half of the load's reads: a disk that gives back
        what it was sent together (a virtual disk completes what it holds as one) returns the first half while it
        reads the rest, and this thread checks the first half meanwhile."""
        reads, waiting, reading = self._reads, self._waiting, self._reading
        while waiting and (
            len(reading) < self.in_flight
            or (
                waiting[0].reads > sum(waiting[0].sizes)  # (bulk read into targets: its bounce bytes are few)
                and reads.pending_bytes + waiting[0].reads <= min(WINDOW_BYTES, self._load_bytes // 2)
                and reads.pending < aio.DEPTH
            )
        ):
            chunk = waiting.popleft()
            need = chunk.bases[-1] + chunk.sizes[-1]
            # (a chunk of small runs takes a buffer of one size: a load of any length reuses those `take_buffers`
            # faulted in; one that reads into its targets needs only its headers' and tails' bytes)
            buf = chunk.buf = self._ctx.buffers.acquire(need if chunk.reads > need else max(self.chunk_bytes, need))
            addr = buf.addr
            chunk.got = [b + d[2] if d else b for b, d in zip(chunk.sizes, chunk.direct)]  # cut short: less
            ops: list[aio.ReadOp] = []
            for k, (f, at, b, n, d) in enumerate(
                zip(chunk.files, chunk.starts, chunk.bases, chunk.sizes, chunk.direct)
            ):
                if d is None:
                    ops.append(aio.ReadOp(f, [(addr + b, n)], at, (chunk, k, 0, n)))
                else:
                    ops += [
                        aio.ReadOp(f, iov, at + rel, (chunk, k, rel, size))
                        for iov, rel, size in cut_pieces(with_target(addr + b, n, d), PIECE_BYTES)
                    ]
            chunk.left = len(ops)
            reading.append(chunk)
            reads.submit(ops)

    def _wait_oldest(self) -> None:
        """Until every read of the oldest chunk out is in (others' as they come)."""
        chunk = self._reading[0]
        while chunk.left:
            for op, n in self._reads.complete():
                c, k, rel, size = op.tag
                if n < size:  # cut short (end of file): the run holds its bytes up to there
                    c.got[k] = min(c.got[k], rel + n)
                c.left -= 1

    def _check(self, chunk: Chunk) -> None:
        """Check each record of a chunk read in, copy the good ones out, give the buffer back."""
        buf = chunk.buf
        assert buf is not None
        try:
            mv = buf.mv
            at_a = chunk.at
            at = at_a.tolist()
            whole = np.asarray(chunk.got)[chunk.run_of] >= chunk.need
            good = whole & (at_a % RECORD_ALIGNMENT == 0) & ~chunk.odd
            if good.all():  # (the common case: every record read whole, no gather of the expected headers)
                good = headers_good(mv, at_a, chunk.expected)
            else:
                fast = np.flatnonzero(good)
                good[fast] = headers_good(mv, at_a[fast], chunk.expected[fast])
            cand = np.flatnonzero(good)
            targets, plen, keys = chunk.targets, chunk.payload_len, chunk.keys
            addr = buf.addr + HEADER_BYTES
            starts = at_a[cand] + HEADER_BYTES
            ends = starts + np.asarray(chunk.stored_len)[cand]
            sources: list[memoryview | ctypes.Array[ctypes.c_char]] = [
                mv[a:b] for a, b in zip(starts.tolist(), ends.tolist())
            ]
            bulk = chunk.bulk[cand]
            for k in np.flatnonzero(bulk).tolist():  # a large payload: its tail after its bulk, hashed in the target
                i, n = int(cand[k]), int(bulk[k])
                _memmove(targets[i] + n, addr + at[i], plen[i] - n)
                sources[k] = (ctypes.c_char * plen[i]).from_address(targets[i])
            passed = np.frombuffer(b"".join(map(_h128, sources)), "V16") == chunk.payload_checksum[cand]
            ok = cand[passed].tolist()
            zstd = chunk.zstd
            for i in cand[passed & (bulk == 0)].tolist():
                if not zstd[i]:
                    _memmove(targets[i], addr + at[i], plen[i])
                    continue
                try:
                    start = at[i] + HEADER_BYTES
                    zstd_decompress_into(mv[start : start + chunk.stored_len[i]], _target(targets[i], plen[i]))
                except CorruptRecord:  # (named with the rest: `decode`)
                    ok.remove(i)
            self._hits += keys if len(ok) == len(keys) else [keys[i] for i in ok]
            if len(ok) < len(at):
                served = set(ok)
                for i in range(len(at)):
                    if i not in served:
                        self._one(chunk, buf, i, bool(whole[i]))
        finally:
            chunk.buf = None
            self._ctx.buffers.release(buf)

    def _one(self, chunk: Chunk, buf: AlignedBuffer, i: int, read_whole: bool) -> None:
        """A record of the chunk the columnar check did not accept, checked on its own bytes (`record_check`): served
        where it is good (copied or decoded into its target), else a fault naming why. It is looked up again in the
        load's transaction (the same value); its key is decoded from the index's spelling."""
        raw_key = chunk.keys[i]
        try:
            value = self._txn.get(raw_key, db=self._ctx.index.obj)
            assert value is not None  # (found in this transaction when the load was planned)
            entry, key, at = IndexEntry.unpack(value), decode_key(raw_key), int(chunk.at[i])
            header_ok = False
            if entry.record_version == FORMAT_VERSION and read_whole:  # (the batch compared only aligned headers)
                header_ok = bool(headers_good(buf.mv, chunk.at[i : i + 1], chunk.expected[i : i + 1])[0])
            device = self._devices.get(chunk.numbers[i])
            if device is not None:
                self._one_device(chunk, buf, i, (read_whole, header_ok), entry, key, device)
                return
            target = _target(chunk.targets[i], entry.payload_len)
            bulk = int(chunk.bulk[i])
            if bulk and read_whole and header_ok:  # its payload's bulk was read into its target: checked there
                _memmove(chunk.targets[i] + bulk, buf.addr + at + HEADER_BYTES, entry.payload_len - bulk)
                if payload_checksum(target) != entry.payload_checksum:
                    raise CorruptRecord(QuarantineReason.PAYLOAD, "payload checksum mismatch")
                self._hits.append(raw_key)
                return
            _, payload_at = check_record(entry, key, buf, at, read_whole, header_ok)
            if entry.codec is Codec.ZSTD:
                zstd_decompress_into(buf.mv[payload_at : payload_at + entry.stored_len], target)
            else:
                _memmove(chunk.targets[i], buf.addr + payload_at, entry.payload_len)
            self._hits.append(raw_key)
        except CorruptRecord as exc:
            self._faults.append((chunk.numbers[i], exc))

    def _one_device(
        self,
        chunk: Chunk,
        buf: AlignedBuffer,
        i: int,
        read: tuple[bool, bool],
        entry: IndexEntry,
        key: ObjectKey,
        device: tuple[torch.Tensor, bool],
    ) -> None:
        """A record of a device target: where GDS reads its payload, its header (all its run read) checked, then the
        payload's read and device checksum sent to the read pool (answered in `finish`); else checked as a host
        target's odd record is and its payload copied (or decoded) into the target. `read`: whether its run read all
        it asked for, and whether the batch check accepted its header. CorruptRecord naming why."""
        (out, gds), (read_whole, header_ok), at = device, read, int(chunk.at[i])
        if not gds:
            _, payload_at = check_record(entry, key, buf, at, read_whole, header_ok)
            fill_device(out, entry, buf, payload_at)
            self._hits.append(chunk.keys[i])
            return
        if not read_whole:
            raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the header")
        if not header_ok:
            raise fault(entry, key, buf.mv, at)
        seg = chunk.files[int(chunk.run_of[i])]
        done = self._ctx.executor("read").submit(read_device, self._ctx.backend, seg, out, entry)
        self._device_reads.append((chunk.numbers[i], chunk.keys[i], done))


def take_buffers(ctx: StoreContext) -> None:
    """Fault in the bounce buffers a load of this path holds at most (IN_FLIGHT + 1 of CHUNK_BYTES) and leave them
    in the store's pool, so a long-lived process's first restore does not pay their pages: touching a fresh buffer costs
    about as much as reading it, and each power-of-two size, once sized by the load, paid it anew."""
    buffers = [ctx.buffers.acquire(PackedLoad.chunk_bytes) for _ in range(PackedLoad.in_flight + 1)]
    for buf in buffers:
        buf.tensor.zero_()
        ctx.buffers.release(buf)


def _target(addr: int, n: int) -> memoryview:
    """The n bytes of target memory at `addr` as a writable memoryview."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


_RUNS_PER_CHUNK = aio.DEPTH // IN_FLIGHT
# The enum members the columns are compared with, as plain ints: numpy compares an array with an IntEnum member
# through a slow path, about four times what an int costs (microseconds per load).
_LIVE, _PLAIN, _ZSTD, _XXH3 = int(RecordState.LIVE), int(Codec.NONE), int(Codec.ZSTD), int(Flags.XXH3)
