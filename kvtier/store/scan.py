"""A scan: records read and checked by the batch pipeline with no target, each good one visited where it lies in the
bounce buffer, each bad one named with its quarantine reason (the verifier's checks, compaction's relocation).

Contract (`PackedScan(ctx, txn, reads, segment, namespace_reason)` as a load's, one scan, one thread, inside
the caller's read transaction, which keeps the records' segments from being unlinked meanwhile):
- `add_items(items, visit, headers=False)`, once, takes records already looked up (`ScanItem`: key, index entry,
  encoded key or b""), numbered in the order given, plans their runs and chunks as a load's (`packed.PackedLoad`) and
  submits the first reads; no namespace is asked whether it is live (the caller chose the records). Any record format
  the store reads is taken: v2 (its header by `header_check.headers_good`, a batch at once) and v1
  (`header_check.check_v1`); any state; stored as is or compressed (the stored bytes are checked, never decoded).
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

import numpy as np

from kvtier.core.tier import ObjectKey
from kvtier.store.errors import CorruptRecord
from kvtier.store.extent import BACKGROUND_IO_BYTES
from kvtier.store.header_check import AnyHeader, headers_good
from kvtier.store.index import IndexEntry, encode_key
from kvtier.store.io import AlignedBuffer
from kvtier.store.packed import EARLY_KEYS, Chunk, PackedLoad
from kvtier.store.record import FORMAT_VERSION
from kvtier.store.record_check import check_record, entry_rows
from kvtier.store.wanted import Wanted


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
    """One scan (the module docstring states the contract).

    A scan is background work beside the engines' loads (the verifier's checks, compaction's reads), so it reads
    one chunk of about BACKGROUND_IO_BYTES at a time (it ends with the record that crosses that size), not a load's
    two of CHUNK_BYTES: a load whose read reaches the disk behind a scan's then waits for one piece, not for
    megabytes (`extent.BACKGROUND_IO_BYTES`)."""

    chunk_bytes = BACKGROUND_IO_BYTES
    in_flight = 1

    _visit: ScanVisit
    _headers: bool
    _items: Sequence[ScanItem]

    def add_items(self, items: Sequence[ScanItem], visit: ScanVisit, headers: bool = False) -> None:
        self._visit, self._headers, self._items = visit, headers, items
        n = len(items)
        for lo, hi in ((0, min(n, EARLY_KEYS)), (EARLY_KEYS, n)):
            part = items[lo:hi]
            if not part:
                continue
            raw = [it.raw_key or encode_key(it.key) for it in part]
            w = Wanted(list(range(lo, hi)), raw, [], [0] * len(part), np.zeros(0, np.uint64), [])
            rows = entry_rows([it.entry for it in part])
            self._queue(rows, w, list(range(len(part))), np.zeros(len(part), bool))
            self._submit()

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
                    self._scan_one(number, item, buf, at, read, good)
                except CorruptRecord as exc:
                    self._faults.append((number, exc))
        finally:
            chunk.buf = None
            self._ctx.buffers.release(buf)

    def _scan_one(self, number: int, item: ScanItem, buf: AlignedBuffer, at: int, read: bool, header_ok: bool) -> None:
        """One record of a chunk checked (`record_check`) and visited; CorruptRecord naming why it is bad."""
        header, payload_at = check_record(item.entry, item.key, buf, at, read, header_ok, self._headers)
        self._visit(number, header, buf.mv, payload_at)
