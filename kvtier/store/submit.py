"""How a load's reads reach the disk: one interface, interchangeable strategies.

Contract (`open_reads(ctx)` lends a `Reads` for one load, used from one thread; `close_reads(reads)` gives it back):
- `submit(ops)` queues scattered reads (`aio.ReadOp`: a segment file, its target memory as (address, length) pairs
  in file order, a file offset) and returns at once; the caller keeps that memory alive until the read is returned
  by `complete()` or waited out by `drain()`.
- `complete()` waits for at least one pending read and returns those that finished, each with the bytes it read:
  fewer than asked only at end of file. A failed read is raised (OSError) only once nothing is in flight, so the
  caller's buffers are never freed under a read still running; after any exception, `drain()` before freeing them.
- `pending` counts the reads submitted and not yet returned, `pending_bytes` the bytes they ask for. Keep about
  aio.DEPTH reads pending.
- `drain()` waits out every read in flight and forgets them and any failure.

The strategies:
- native AIO (`aio.AioContext`): every read in flight at once from the loading thread; where segments are O_DIRECT
  and the kernel lends a context (`aio.acquire`).
- threads (`ThreadReads`): each read a positional read (`SegmentFile.preadv_into`) on the store's read pool, at
  most `read_threads` at a time; where native AIO is refused, or segments are buffered (io_submit on a buffered
  file reads synchronously, no better than the loading thread reading them itself).
- GDS is not one of them: cuFile reads one device buffer per call, so a device target's payload is read by itself
  into its slot on the read pool (`device_rows.read_device`), once its header came through one of these.

`with_target(at, n, direct)` and `cut_pieces(iov, piece)` shape a run's read that ends in a payload read straight into
its target: its iov, then that iov cut into reads of at most about `piece` bytes.

Why one interface: the planning of runs, the checks and the copies out (`packed.PackedLoad`, `scan.PackedScan`)
are the same whichever way the bytes arrive; only the submission differs, so it is the only part chosen per host.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvtier.store import aio
from kvtier.store.context import StoreContext


class Reads(Protocol):
    """A submit strategy (the module docstring states the contract)."""

    @property
    def pending(self) -> int: ...
    @property
    def pending_bytes(self) -> int: ...
    def submit(self, ops: list[aio.ReadOp]) -> None: ...
    def complete(self) -> list[tuple[aio.ReadOp, int]]: ...
    def drain(self) -> None: ...


class ThreadReads:
    """Reads on a thread pool, `lanes` at a time: each lane takes the next read queued as it finishes one, so the
    reads reach the disk in the order submitted and a slow one holds up only its own lane."""

    def __init__(self, pool: ThreadPoolExecutor, lanes: int) -> None:
        self._pool, self._lanes = pool, max(1, lanes)
        self._todo: deque[aio.ReadOp] = deque()
        self._done: queue.SimpleQueue[tuple[aio.ReadOp, int, BaseException | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the queue of reads and the count of lanes running
        self._running = 0
        self._inflight = 0
        self._pending_bytes = 0
        self._error: BaseException | None = None

    @property
    def pending(self) -> int:
        return self._inflight

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def submit(self, ops: list[aio.ReadOp]) -> None:
        for op in ops:
            op.nbytes = sum(n for _, n in op.iov)
            self._pending_bytes += op.nbytes
        self._inflight += len(ops)
        with self._lock:
            self._todo.extend(ops)
            start = min(self._lanes - self._running, len(self._todo))
            self._running += start
        for _ in range(start):
            self._pool.submit(self._lane)

    def _lane(self) -> None:
        while True:
            with self._lock:  # (a lane stops only with nothing queued: `submit` starts another for what comes next)
                if not self._todo:
                    self._running -= 1
                    return
                op = self._todo.popleft()
            try:
                self._done.put((op, op.file.preadv_into(aio.views_of(op.iov), op.offset), None))
            except BaseException as exc:  # handed to the loading thread, which would otherwise wait for it forever
                self._done.put((op, -1, exc))

    def complete(self) -> list[tuple[aio.ReadOp, int]]:
        if not self._inflight:
            return []
        got = [self._done.get()]
        while True:
            try:
                got.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._inflight -= len(got)
        done: list[tuple[aio.ReadOp, int]] = []
        for op, n, exc in got:
            self._pending_bytes -= op.nbytes
            if exc is not None:
                self._error = self._error or exc
            else:
                done.append((op, n))
        if not self._inflight and self._error is not None:
            err, self._error = self._error, None
            raise err
        return done

    def drain(self) -> None:
        aio.drain(self)


def open_reads(ctx: StoreContext) -> Reads:
    """Native AIO where the store's segments are O_DIRECT and the kernel lends a context, else the read pool."""
    if ctx.backend.direct:
        native = aio.acquire()
        if native is not None:
            return native
    return ThreadReads(ctx.executor("read"), ctx.config.read_threads)


def close_reads(reads: Reads) -> None:
    """Wait out what is in flight; a native context goes back to be lent again."""
    if isinstance(reads, aio.AioContext):
        aio.release(reads)
    else:
        reads.drain()


def with_target(at: int, n: int, direct: tuple[int, int, int]) -> list[tuple[int, int]]:
    """A run's read ending in a large record's payload (`n` bytes of the buffer at address `at`; `direct`: where the
    payload starts in the run, the target's address, the bulk's length): the bytes before the bulk into the buffer,
    the bulk into the target, the rest into the buffer after the bytes before it."""
    start, target, bulk = direct
    return [(at, start), (target, bulk), (at + start, n - start)] if n > start else [(at, start), (target, bulk)]


def cut_pieces(iov: list[tuple[int, int]], piece: int) -> list[tuple[list[tuple[int, int]], int, int]]:
    """A read's iov cut where its bytes cross a multiple of `piece` (from the read's start): (iov, where the piece
    starts in the read, its bytes) each. A last piece under a quarter of `piece` joins the one before (a record's
    header and tail beside its payload are no read of their own). The cuts keep O_DIRECT's alignment: `piece` is a
    multiple of it, and so is every iov entry's address and length but the last's length."""
    total = sum(n for _, n in iov)
    cuts = list(range(piece, total, piece))
    if cuts and total - cuts[-1] < piece // 4:
        cuts.pop()
    out: list[tuple[list[tuple[int, int]], int, int]] = []
    cur: list[tuple[int, int]] = []
    start = pos = 0
    bounds = iter([*cuts, total])
    bound = next(bounds)
    for addr, n in iov:
        while n:
            take = min(n, bound - pos)
            cur.append((addr, take))
            addr, n, pos = addr + take, n - take, pos + take
            if pos == bound:
                out.append((cur, start, pos - start))
                cur, start = [], pos
                bound = next(bounds, total)
    return out
