"""Segment bytes read as they lie on disk, with none of a load's work: no lookup, no check, no copy out.

Contract (`SpanReader.open(root, segment_ids)`, one thread):
- Returns None where native AIO is not to be had (`aio.acquire`); otherwise a reader holding each named segment of
  the store at `root` open with O_DIRECT. FileNotFoundError for a segment that is not there.
- `read(spans, target)` reads each `{segment id: (start, end)}` span (start and end multiples of 4096) back to back
  into `target` (a writable buffer at least as long as the spans together, at an address O_DIRECT takes), cut into
  pieces of a load's piece size, all in flight at once, and returns once every read is in.
- `close()` (always) waits out any read in flight and closes the files.

Why: a benchmark's bound on a cold load is the disk reading the same bytes in the same reads, which only the
store knows how to issue; this is that read, through the store's public interface.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from kvtier.store import aio
from kvtier.store.aio import AIO_PIECE_BYTES
from kvtier.store.io import SegmentFile
from kvtier.store.segments import SEGMENTS_DIR, segment_name


class SpanReader:
    """Raw O_DIRECT reads of segment spans through native AIO (the module docstring states the contract)."""

    def __init__(self, ctx: aio.AioContext, files: dict[int, SegmentFile]) -> None:
        self._ctx, self._files = ctx, files

    @classmethod
    def open(cls, root: str, segment_ids: Iterable[int]) -> SpanReader | None:
        ctx = aio.acquire()
        if ctx is None:
            return None
        files: dict[int, SegmentFile] = {}
        try:
            for seg in set(segment_ids):
                path = os.path.join(root, SEGMENTS_DIR, segment_name(seg))
                files[seg] = SegmentFile(path, os.open(path, os.O_RDONLY | os.O_DIRECT))
        except BaseException:
            for f in files.values():
                f.close()
            aio.release(ctx)
            raise
        return cls(ctx, files)

    def read(self, spans: dict[int, tuple[int, int]], target: memoryview) -> None:
        ops, at = [], 0
        for seg, (lo, hi) in spans.items():
            for off in range(lo, hi, AIO_PIECE_BYTES):
                n = min(AIO_PIECE_BYTES, hi - off)
                ops.append(aio.ReadOp(self._files[seg], aio.iov_of([target[at : at + n]]), off, None, 0))
                at += n
        self._ctx.submit(ops)
        while self._ctx.pending:
            self._ctx.complete()

    def close(self) -> None:
        try:
            self._ctx.drain()
        finally:
            aio.release(self._ctx)
            for f in self._files.values():
                f.close()
            self._files.clear()
