"""A load's runs read in waves, from one thread, each record checked as soon as its bytes are in.

Contract (`WaveRead(reads, runs, buffers, plan, place, check, more=None).run()`; `reads`: a submit strategy,
`kvtier.store.submit`, native AIO or the read pool's threads):
- `more`, if given, returns the load's other runs; it is called once, after the reads of `runs` are submitted (or at
  once if `runs` has none to read): a load looks up its other keys while the disk reads its first.
- Every run is read once, cut into pieces of about AIO_PIECE_BYTES (`split_read`), with at most AIO_WINDOW_BYTES
  and aio.DEPTH pieces in flight. Runs are planned (`plan`: the run's segment and scatter, or its jobs' faults when
  the segment is gone) and placed (`place`: its views) in groups of up to AIO_GROUP as the window needs them, one
  bounce buffer from `buffers` a group, while less than AIO_BOUNCE_BYTES of buffers are out.
- `check(rr, got, first, stop)` gets a run's jobs[first:stop] once the bytes read from the run's start reach file
  offset `got` past their records; once no piece of the run is in flight, every job not yet checked (a record a
  short read left incomplete is the caller's to fail). Each job is checked exactly once, in file order; the
  results of `plan` and `check` are returned together.
- Whenever reads of a piece's worth or more finish, the window is refilled before they are checked (smaller
  ones are checked first, so their bounce buffers go back before the next reads take theirs), and the next runs
  are planned while the refill reads. In a load of two pieces or more whose runs average half a piece or more,
  the pieces that reach into its last eighth (at most the last eighth of a window) go only once everything
  before them is in.
- On return or exception nothing is in flight and every bounce buffer is given back.

Why waves: some disks (virtual ones among them) complete everything they hold at once: every piece of a batch comes
back from one io_getevents call. With a whole batch in flight, the disk then sits idle while this thread checks the
batch (its checksums and header checks, a noticeable share of its read). Held back, the last pieces keep it reading
while the rest is checked. A disk that completes reads one by
one gets the same from the refill: the window is topped up as each read comes back.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.store import aio
from kvtier.store.extent import Run, Scatter
from kvtier.store.io import AlignedBuffer, BufferPool, SegmentFile, readable, split_read
from kvtier.store.submit import Reads

J = TypeVar("J")
R = TypeVar("R")

# Bounce buffers one load keeps out: the small records of a million-token restore would otherwise all be read into
# memory at once before the first is checked.
AIO_BOUNCE_BYTES = 64 << 20
# Runs planned together, their bounce bytes in one buffer.
AIO_GROUP = 16
# Bytes in flight at once, and the piece a run's read is cut into (into huge-page pool memory a piece goes to the
# disk in requests of up to max_sectors_kb: kvtier.core.hugepages). Smaller pieces in a smaller window keep more
# requests in flight for the same bytes: DSV4 restores in batches read faster so, and one large load no slower
# (bench/restore.py and bench/peers.py measure both).
AIO_WINDOW_BYTES = 32 << 20
AIO_PIECE_BYTES = 2 << 20


@dataclasses.dataclass(slots=True)
class BounceShare:
    """A bounce buffer lent to `runs` runs (one read's, or a group's read through AIO), given back after the last."""

    buf: AlignedBuffer
    runs: int


@dataclasses.dataclass(slots=True)
class RunRead(Generic[J]):
    """One run's read as placed: its segment, where its bytes go (the share's buffer from `base`, and direct
    targets: `views`, in file order). Read through AIO, its views are cut into `pieces` (`split_read`), `got` holds
    per piece the bytes read (-1 while it is in flight) and `checked` counts its jobs checked so far; the thread
    path reads `views` whole."""

    run: Run[J]
    seg: SegmentFile
    plan: Scatter
    share: BounceShare
    base: int
    views: list[memoryview]
    pieces: list[tuple[list[memoryview], int, int]] = dataclasses.field(default_factory=list)
    got: list[int] = dataclasses.field(default_factory=list)
    checked: int = 0


Planned = tuple[Run[J], SegmentFile, Scatter]
Plan = Callable[[Run[J]], "Planned[J] | list[R]"]
Place = Callable[[Run[J], SegmentFile, Scatter, BounceShare, int], RunRead[J]]
Check = Callable[[RunRead[J], int, int, int], list[R]]


class WaveRead(Generic[J, R]):
    """One load's reads (`run()` them once; the module docstring states the contract): the pieces placed and not yet
    submitted, the bounce buffers lent, the results so far."""

    def __init__(
        self,
        ctx: Reads,
        runs: Sequence[Run[J]],
        buffers: BufferPool,
        plan: Plan[J, R],
        place: Place[J],
        check: Check[J, R],
        *,
        more: Callable[[], Sequence[Run[J]]] | None = None,
    ) -> None:
        self.ctx, self.buffers, self.plan, self.place, self.check = ctx, buffers, plan, place, check
        self.results: list[R] = []
        self.lent: list[BounceShare] = []
        self.queue: deque[aio.ReadOp] = deque()
        self.pending: Iterator[Run[J]] = iter(())
        self.next_run: Run[J] | None = None
        self.more = more
        self.runs = self.total = self.submitted = 0
        self.last_wave_from = 1 << 62  # no holdback before the load's last runs are known
        self._take(runs)

    def _take(self, runs: Sequence[Run[J]]) -> None:
        """Queue runs to plan after those taken before; once the last are taken, where the last wave starts."""
        self.pending = iter(runs)
        self.next_run = next(self.pending, None)
        self.runs += len(runs)
        self.total += sum(r.end - r.start for r in runs)
        if self.more is None:
            total = self.total
            # Only loads of large runs hold back: where runs are small, the window is refilled run by run as reads
            # come back, which already overlaps checking and reading, and a held-back wave would drain the queue
            # first (fewer objects/s on random small records). A load of less than two
            # pieces is checked sooner than a second wave would come back.
            large = total >= 2 * AIO_PIECE_BYTES and total >= self.runs * AIO_PIECE_BYTES // 2
            self.last_wave_from = total - min(total, AIO_WINDOW_BYTES) // 8 if large else total

    def run(self) -> list[R]:
        """Read and check every run; the results of `plan` and `check`."""
        ctx = self.ctx
        try:
            self._refill()
            while ctx.pending:
                finished: dict[int, RunRead[J]] = {}
                done = 0
                for op, n in ctx.complete():
                    rr, k = op.tag
                    rr.got[k] = n
                    finished[id(rr)] = rr
                    done += n
                # Refill first where the checks are worth overlapping (hashing a piece or more). Small reads are
                # checked first: their bounce buffers go back before the next reads take theirs (refilled first, a
                # load of small runs holds twice the buffers, and faults in their fresh pages).
                large = done >= AIO_PIECE_BYTES
                if large:
                    self._refill()
                for rr in finished.values():
                    self._check_ready(rr)
                if not large or not ctx.pending:
                    self._refill()  # (also what the bounce buffers or the last wave held back)
                if ctx.pending:
                    self._restock(AIO_WINDOW_BYTES)  # the next window planned while this one reads
            return self.results
        finally:
            ctx.drain()  # after an exception: no read may still be filling a buffer given back below
            for share in self.lent:
                self.buffers.release(share.buf)

    def _refill(self) -> None:
        """Submit queued pieces while the window has room; the first always goes when nothing is in flight (a
        window smaller than a piece still moves)."""
        ctx, queue = self.ctx, self.queue
        self._restock(1)
        last_wave_from = self.last_wave_from
        ops: list[aio.ReadOp] = []
        # Locals, not properties and fields: this loop runs per piece of every load.
        room, nbytes, submitted = aio.DEPTH - ctx.pending, ctx.pending_bytes, self.submitted
        busy = room < aio.DEPTH
        while queue and room > 0:
            n = queue[0].nbytes
            if busy and (nbytes + n > AIO_WINDOW_BYTES or submitted <= last_wave_from < submitted + n):
                break
            ops.append(queue.popleft())
            nbytes += n
            submitted += n
            room -= 1
            busy = True
            if not queue:  # submit what is placed: the first reads reach the disk while the next runs are planned
                ctx.submit(ops)
                ops = []
                self._restock(1)
                last_wave_from = self.last_wave_from  # (known once the load's last runs are)
        if ops:
            ctx.submit(ops)
        self.submitted = submitted

    def _restock(self, need: int) -> None:
        """Plan runs until `need` bytes (or AIO_GROUP pieces) wait in the queue, no run is left, or the bounce
        buffers are spent while reads are out (checks give them back). (Planned further ahead, a load of small
        runs would hold more bounce buffers at once: more fresh pages to fault in.)"""
        queue = self.queue
        if self.next_run is None and self.more is not None and (self.ctx.pending or not queue):
            more, self.more = self.more, None  # the first runs' reads are out (or there were none)
            self._take(more())
        # (the queue's bytes summed only while it holds fewer than AIO_GROUP pieces)
        while self.next_run is not None and len(queue) < AIO_GROUP and sum(op.nbytes for op in queue) < need:
            if self.ctx.pending and sum(share.buf.capacity for share in self.lent) >= AIO_BOUNCE_BYTES:
                return
            self._place_group()

    def _place_group(self) -> None:
        """Up to AIO_GROUP runs (about a window of reads at most) planned, placed in one bounce buffer and queued."""
        group: list[Planned[J]] = []
        size = reads = 0
        run = self.next_run
        while run is not None and len(group) < AIO_GROUP and reads < AIO_WINDOW_BYTES:
            reads += run.end - run.start
            planned = self.plan(run)
            run = next(self.pending, None)
            if isinstance(planned, list):
                self.results += planned
            else:
                group.append(planned)
                size += align_up(planned[2].bounce_bytes, DISK_ALIGNMENT)
        self.next_run = run
        if not group:
            return
        share = BounceShare(self.buffers.acquire(size), len(group))
        self.lent.append(share)
        base = 0
        for r, seg, scatter in group:
            rr = self.place(r, seg, scatter, share, base)
            base += align_up(scatter.bounce_bytes, DISK_ALIGNMENT)
            rr.pieces = split_read(rr.views, r.start, AIO_PIECE_BYTES)
            rr.got = [-1] * len(rr.pieces)
            self.queue.extend(aio.ReadOp(seg, aio.iov_of(v), at, (rr, k), n) for k, (v, at, n) in enumerate(rr.pieces))

    def _check_ready(self, rr: RunRead[J]) -> None:
        """Check the run's jobs whose records are all in; give the share back after its last run's last job."""
        jobs: list[tuple[int, int, Any]] = rr.run.jobs
        if len(rr.got) == 1:  # one piece: in, all of it (the common case of small runs, per run of every load)
            final, got = True, rr.run.start + rr.got[0]
        else:
            upto, final = readable(rr.pieces, rr.got)
            got = rr.run.start + upto
        stop = rr.checked
        if final:
            stop = len(jobs)
        else:
            while stop < len(jobs) and jobs[stop][0] + jobs[stop][1] <= got:
                stop += 1
        if stop > rr.checked:
            self.results += self.check(rr, got, rr.checked, stop)
            rr.checked = stop
        if final:
            rr.share.runs -= 1
            if not rr.share.runs:
                self.lent.remove(rr.share)
                self.buffers.release(rr.share.buf)
