"""Let the process's other threads run during a long pure-Python loop: the decision applier's.

The daemon's applier thread applies the verifier's decisions (a drop of a batch of records, a stamp, a repoint) in
the same process whose threads serve loads. A Python loop keeps the GIL until the interpreter's switch interval
(`sys.getswitchinterval()`) forces a hand-over, and a load thread whose I/O has completed waits for the GIL that
long each time it needs it back: the loads' p99 feels every millisecond of the applier's loop. A loop that calls a
`Yielder` each item gives the GIL up (`os.sched_yield`, which releases it) every `YIELD_EVERY_S` of its own
running, so a waiting thread takes it then; `bench/verifier.py`'s writing windows measure the effect.

Only on the applier's thread (inside `applying()`): the same loops run in a verifier with no daemon, at the
lowest priority, where a yield of the CPU on a busy machine would cost it a wait for every other task. The
store's access-time thread flushes inside `applying()` too (`kvtier.store.atimes`): the same kind of background
bookkeeping, beside the same loads and durable batches.

`DurableFirst` orders the same thread's write transactions after the daemon's durable batches (the index's
`writers`): a decision's commit holds LMDB's write lock through its sync, and a durable offload waits for it.

`Piece` bounds what one of the applier's write transactions holds the daemon back. The lock is held for the
transaction's whole body, and on a busy machine that body's wall time is not its own work: its thread waits for a
CPU (the run queue) and, after each yield, for the GIL, all with the write lock held. So a loop asks its `Piece`
before each item whether to end the transaction there: at once when another thread of the process waits for the
write lock (`DurableFirst.wanted`, which `Index.update` raises while it waits: a durable batch's commit, a pin),
and in any case once the body has run `PIECE_S`. The caller commits what its piece did and goes on in the next
transaction. Another writer of this process therefore waits for at most one item of a decision plus that piece's
commit, never for the decision, however many records it carries. A decision costs a commit per piece, so the time
bound sits well above a piece's usual length (a batch of `VerifierSettings.batch_records` usually fits in one).
Only on the applier's thread, like the yields: a verifier with no daemon has no such neighbours.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

YIELD_EVERY_S = 0.0005  # far below the switch interval, far above the cost of a yield (a system call)


_local = threading.local()


@contextlib.contextmanager
def applying() -> Iterator[None]:
    """Mark this thread as the applier's (or the access-time flush's) for the block: its Yielders yield, its
    Pieces end for waiting writers, its write transactions hold back for durable batches."""
    _local.on = True
    try:
        yield
    finally:
        _local.on = False


class Yielder:
    """Call once per item of a loop: on the applier's thread, every `every_s` since the last yield, release the GIL
    and the CPU once; elsewhere, nothing."""

    __slots__ = ("_at", "_every", "_on")

    def __init__(self, every_s: float = YIELD_EVERY_S) -> None:
        self._on = getattr(_local, "on", False)
        self._every = every_s
        self._at = time.perf_counter()

    def __call__(self) -> None:
        if self._on and time.perf_counter() - self._at >= self._every:
            os.sched_yield()  # releases the GIL around the call: a thread waiting for it takes it now
            self._at = time.perf_counter()


PIECE_S = 0.02  # the longest one write transaction of the applier's runs before it commits (see Piece)
HOLD_BACK_S = 1.0  # the longest the applier holds back one write transaction: the verifier's decisions still go on


def on_applier_thread() -> bool:
    return bool(getattr(_local, "on", False))


class DurableFirst:
    """Durable writes before the applier's: while a batch is being made durable in this process (its segment
    bytes synced, then its index commit, `durable()`), the applier's thread holds back its next write
    transaction until the batches under way when it came are done (at most `max_wait_s`; batches begun later do
    not hold it: under back-to-back offloads it still gets one transaction in between), so a batch's commit finds
    LMDB's write lock free rather than behind a decision's commit and its sync. `wanted` says whether another
    thread waits for the write lock right now; a `Piece` of the applier's ends on it."""

    def __init__(self, max_wait_s: float = HOLD_BACK_S) -> None:
        self._cond = threading.Condition()
        self._active: set[int] = set()
        self._next = 0
        self._wanted = 0
        self.max_wait_s = max_wait_s
        self.held_back = 0  # how many of the applier's transactions waited for a durable batch

    @contextlib.contextmanager
    def durable(self) -> Iterator[None]:
        with self._cond:
            self._next += 1
            batch = self._next
            self._active.add(batch)
        try:
            yield
        finally:
            with self._cond:
                self._active.discard(batch)
                self._cond.notify_all()

    @property
    def under_way(self) -> bool:
        """Whether a durable batch is being made durable now."""
        return bool(self._active)

    @contextlib.contextmanager
    def wanting(self) -> Iterator[None]:
        """Around another thread's wait for the write lock (`Index.update`); nothing on the applier's own thread."""
        if on_applier_thread():
            yield
            return
        with self._cond:
            self._wanted += 1
        try:
            yield
        finally:
            with self._cond:
                self._wanted -= 1

    @property
    def wanted(self) -> bool:
        """Whether another thread of the process waits for the write lock now (read without the lock: a hint
        checked per item, which a waiter sets before it asks LMDB for the lock)."""
        return self._wanted > 0

    def before_write(self) -> None:
        """Called before a write transaction: on the applier's thread, wait for the durable batches under way."""
        if not on_applier_thread():
            return
        with self._cond:
            if self._active:
                self.held_back += 1
                those = set(self._active)
                self._cond.wait_for(lambda: not (those & self._active), timeout=self.max_wait_s)


class Piece:
    """Ask `over()` before each item of a write transaction's loop, from inside the transaction: on the
    applier's thread, True once the transaction has done at least one item and another thread waits for the write
    lock or `budget_s` has passed since the Piece was made; the loop then stops where it is, and its caller commits
    and goes on in a new transaction. Elsewhere never: the loop runs whole in one transaction. Gives the GIL up as
    a `Yielder`."""

    __slots__ = ("_end", "_items", "_on", "_pause", "_writers")

    def __init__(self, writers: DurableFirst, budget_s: float = PIECE_S) -> None:
        self._on = on_applier_thread()
        self._writers = writers
        self._end = time.perf_counter() + budget_s
        self._items = 0
        self._pause = Yielder()

    def over(self) -> bool:
        if not self._on:
            return False
        self._items += 1
        if self._items > 1 and (self._writers.wanted or time.perf_counter() >= self._end):
            return True
        self._pause()
        return False


def between_pieces() -> None:
    """After a piece's commit, before the next: the GIL and the CPU to the process's other threads once."""
    if on_applier_thread():
        os.sched_yield()


R = TypeVar("R")


def in_pieces(piece: Callable[[int], tuple[R, int]], items: int) -> list[R]:
    """Run `piece(start)` (one transaction over the items from `start` on, ending where a `Piece` says; returns
    its result and where it stopped) until all `items` are done, at least once, with `between_pieces` between
    two; the pieces' results in order."""
    results: list[R] = []
    at = 0
    while True:
        result, at = piece(at)
        results.append(result)
        if at >= items:
            return results
        between_pieces()
