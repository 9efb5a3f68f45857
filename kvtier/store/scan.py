"""A scan: records read and checked by the batch pipeline with no target, each good one visited where it lies in the
bounce buffer, each bad one named with its quarantine reason (the verifier's checks, compaction's relocation).

Contract (`PackedScan(ctx, txn, reads, segment, namespace_reason, visit, headers=False)`, one scan, one thread, inside
the caller's read transaction, which keeps the records' segments from being unlinked meanwhile):
- `add_items(items)` takes records already looked up (`ScanItem`: key, index entry, encoded key or b""), numbered in the
  order given across calls, plans their runs and chunks as a load's (`packed.PackedLoad`) and submits the first
  reads. Any record format the store reads is taken: v2 (its header by `header_check.headers_good`, a batch at once)
  and v1 (`header_check.check_v1`); any state (the caller chose them); stored as is or compressed (the stored bytes
  are checked, never decoded).
- `finish_scan()` waits for every read and checks each record: read whole, its header, then every payload checksum the
  record carries that the host computes (xxh3_128, else the device checksum on cpu). For a good one it calls
  `visit(number, header, mv, payload_at)` while its bytes are in `mv` (valid only during the call: the buffer is
  reused), `header` the parsed header where `headers=True` (always for v1), else None. It returns the bad ones as
  (number, CorruptRecord), the error naming the quarantine reason: `segment_missing`, `segment_truncated`, the
  header's fault (`header_check.fault`, run on the bytes already read), or `payload`.
- `close()` (always) waits out every read in flight and gives the bounce buffers back.

Why a use of the load's pipeline and not a read path of its own: the reads are planned, submitted (native AIO or
threads, `kvtier.store.submit`) and bounded in memory the same way; only what happens to a checked record differs
(visited here, copied to a target there), and why one failed is named on the bytes already read, never by reading it
again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import lmdb
import numpy as np

from kvtier.core.forms import Reason
from kvtier.core.tier import ObjectKey
from kvtier.store.context import StoreContext
from kvtier.store.devsum import device_checksum
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.header_check import AnyHeader, check_v1, fault, headers_good
from kvtier.store.index import ENTRY_V2_DTYPE, IndexEntry, encode_key
from kvtier.store.io import AlignedBuffer, SegmentFile
from kvtier.store.packed import EARLY_KEYS, Chunk, PackedLoad
from kvtier.store.record import FORMAT_VERSION, HEADER_BYTES, Flags, RecordHeader, payload_checksum
from kvtier.store.record_v1 import V1_HEADER_BYTES
from kvtier.store.submit import Reads
from kvtier.store.wanted import Wanted

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch


@dataclasses.dataclass(slots=True)
class ScanItem:
    """One record to scan: its key, its index entry, and its key as the index spells it where the caller has it
    (b"": encoded here)."""

    key: ObjectKey
    entry: IndexEntry
    raw_key: bytes = b""


# visit(number, header or None, bytes, where the stored payload starts in them)
ScanVisit = Callable[[int, "AnyHeader | None", memoryview, int], None]


class PackedScan(PackedLoad):
    """One scan (the module docstring states the contract)."""

    def __init__(
        self,
        ctx: StoreContext,
        txn: lmdb.Transaction,
        reads: Reads,
        segment: Callable[[int], SegmentFile],
        namespace_reason: Callable[[lmdb.Transaction, bytes], Reason],
        visit: ScanVisit,
        headers: bool = False,
    ) -> None:
        super().__init__(ctx, txn, reads, segment, namespace_reason)
        self._visit, self._headers = visit, headers
        self._items: list[ScanItem] = []
        self._faults: list[tuple[int, CorruptRecord]] = []

    def add_items(self, items: Sequence[ScanItem]) -> None:
        first = len(self._items)
        self._items += items
        n = len(items)
        for lo, hi in ((0, min(n, EARLY_KEYS)), (EARLY_KEYS, n)):
            part = items[lo:hi]
            if not part:
                continue
            raw = [it.raw_key or encode_key(it.key) for it in part]
            w = Wanted(list(range(first + lo, first + hi)), raw, [], [0] * len(part), np.zeros(0, np.uint64), [])
            gone = self._queue(entry_rows([it.entry for it in part]), w, list(range(len(part))))
            self._faults += [(number, self._missing(number)) for number in gone]
            self._submit()

    def _missing(self, number: int) -> CorruptRecord:
        """Why a record's segment could not be opened, as the same call says it."""
        seg_id = self._items[number].entry.segment
        try:
            self._segment(seg_id)
        except CorruptRecord as exc:
            return exc
        return CorruptRecord(QuarantineReason.SEGMENT_MISSING, f"segment {seg_id:016x} could not be opened")

    def finish_scan(self) -> list[tuple[int, CorruptRecord]]:
        """`finish` for a scan: the bad records (the module docstring)."""
        self.finish()
        return self._faults

    def _check(self, chunk: Chunk) -> None:
        buf = chunk.buf
        assert buf is not None
        try:
            mv = buf.mv
            items = [self._items[n] for n in chunk.numbers]
            whole = np.asarray(chunk.got)[chunk.run_of] >= chunk.need
            v2 = np.fromiter((it.entry.record_version == FORMAT_VERSION for it in items), bool, len(items))
            header_ok = np.zeros(len(items), bool)
            batch = np.flatnonzero(whole & v2)
            header_ok[batch] = headers_good(mv, chunk.at[batch], chunk.expected[batch])
            for number, item, at, read, good in zip(
                chunk.numbers, items, chunk.at.tolist(), whole.tolist(), header_ok.tolist()
            ):
                try:
                    self._one(number, item, buf, at, read, good)
                except CorruptRecord as exc:
                    self._faults.append((number, exc))
        finally:
            chunk.buf = None
            self._ctx.buffers.release(buf)

    def _one(self, number: int, item: ScanItem, buf: AlignedBuffer, at: int, read: bool, header_ok: bool) -> None:
        """One record of a chunk checked and visited; CorruptRecord naming why it is bad."""
        e, mv = item.entry, buf.mv
        if not read:
            raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, f"segment {e.segment:016x} ends inside the record")
        header: AnyHeader | None
        if e.record_version == FORMAT_VERSION:
            if not header_ok:
                raise fault(e, item.key, mv, at)  # (only names what is wrong: the batch check refused it)
            header = RecordHeader.unpack(mv, at) if self._headers else None
            payload_at = at + HEADER_BYTES
        else:
            header = check_v1(e, item.key, mv, at)
            payload_at = at + V1_HEADER_BYTES
        check_sums(e, mv[payload_at : payload_at + e.stored_len], buf.tensor, payload_at)
        self._visit(number, header, mv, payload_at)


def entry_rows(entries: Sequence[IndexEntry]) -> np.ndarray:
    """IndexEntry objects as ENTRY_V2_DTYPE rows (the fields the pipeline plans and checks with), any record format:
    a scan's caller has parsed its entries already."""
    rows = np.zeros(len(entries), ENTRY_V2_DTYPE)
    if not entries:
        return rows
    for name in ("segment", "offset", "record_len", "payload_len", "stored_len", "created", "device_checksum"):
        rows[name] = [getattr(e, name) for e in entries]
    rows["codec"] = [int(e.codec) for e in entries]
    rows["flags"] = [e.flags for e in entries]
    rows["version"] = [e.record_version for e in entries]
    rows["payload_checksum"] = np.frombuffer(b"".join([e.payload_checksum for e in entries]), "V16")
    rows["layout_digest"] = np.frombuffer(b"".join([e.layout_digest for e in entries]), "V16")
    return rows


_XXH3 = int(Flags.XXH3)


def check_sums(entry: IndexEntry, data: memoryview, tensor: torch.Tensor, at: int) -> None:
    """Every checksum the record carries that the host can compute cheaply: xxh3, else the device sum on cpu.
    `data` (the stored payload) is also tensor[at : at + stored_len], sliced only for the device sum."""
    if entry.flags & _XXH3:
        if payload_checksum(data) != entry.payload_checksum:
            raise CorruptRecord(QuarantineReason.PAYLOAD, "payload checksum mismatch")
    elif device_checksum(tensor[at : at + entry.stored_len]) != entry.device_checksum:
        raise CorruptRecord(QuarantineReason.PAYLOAD, "payload device checksum mismatch")
