"""Let the process's other threads run during a long pure-Python loop: the decision applier's.

The daemon's applier thread applies the verifier's decisions (a drop of a batch of records, a stamp, a repoint) in
the same process whose threads serve loads. A Python loop keeps the GIL until the interpreter's switch interval
(`sys.getswitchinterval()`) forces a hand-over, and a load thread whose I/O has completed waits for the GIL that
long each time it needs it back: the loads' p99 feels every millisecond of the applier's loop. A loop that calls a
`Yielder` each item gives the GIL up (`os.sched_yield`, which releases it) every `YIELD_EVERY_S` of its own
running, so a waiting thread takes it then; `bench/verifier.py`'s writing windows measure the effect.

Only on the applier's thread (inside `applying()`): the same loops run in a verifier with no daemon, at the
lowest priority, where a yield of the CPU on a busy machine would cost it a wait for every other task.

`DurableFirst` orders the same thread's write transactions after the daemon's durable batches (the index's
`writers`): a decision's commit holds LMDB's write lock through its sync, and a durable offload waits for it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

YIELD_EVERY_S = 0.0005  # far below the switch interval, far above the cost of a yield (a system call)


_local = threading.local()


@contextlib.contextmanager
def applying() -> Iterator[None]:
    """Mark this thread as the applier's for the block: its Yielders yield."""
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


HOLD_BACK_S = 1.0  # the longest the applier holds back one write transaction: the verifier's decisions still go on


def on_applier_thread() -> bool:
    return bool(getattr(_local, "on", False))


class DurableFirst:
    """Durable writes before the applier's: while a batch is being made durable in this process (its segment
    bytes synced, then its index commit, `durable()`), the applier's thread holds back its next write
    transaction, up to `max_wait_s`, so the batch's commit finds LMDB's write lock free rather than behind a
    decision's commit and its sync. A transaction the applier already began is not cut short: a batch waits for
    at most that one."""

    def __init__(self, max_wait_s: float = HOLD_BACK_S) -> None:
        self._cond = threading.Condition()
        self._durable = 0
        self.max_wait_s = max_wait_s
        self.held_back = 0  # how many of the applier's transactions waited for a durable batch

    @contextlib.contextmanager
    def durable(self) -> Iterator[None]:
        with self._cond:
            self._durable += 1
        try:
            yield
        finally:
            with self._cond:
                self._durable -= 1
                self._cond.notify_all()

    def before_write(self) -> None:
        """Called before a write transaction: on the applier's thread, wait while a durable batch is under way."""
        if not on_applier_thread():
            return
        with self._cond:
            if self._durable:
                self.held_back += 1
                self._cond.wait_for(lambda: self._durable == 0, timeout=self.max_wait_s)
