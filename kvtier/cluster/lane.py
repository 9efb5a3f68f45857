"""Calls into a client library that may block for seconds, made to answer within a deadline.

A lane is one worker thread and one lock. A caller that cannot get the lock, or whose call does not
finish, within its deadline gets `ClusterUnavailable`; a call past its deadline keeps the lock until it
really returns, so the buffers it writes into are never handed to the next caller meanwhile.

A slow answer is not a dead cluster: on a loaded host an existence call can miss a short deadline while the
master is fine. So a lane's timeout is a miss for that call only, and it asks the link's prober to probe at
once; only a probe (`Probes`) without an answer in time, or an answer made of error codes, marks the cluster
down. While down, calls fail at once for `retry_s`, then one is let through.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from kvtier.cluster.errors import ClusterUnavailable

T = TypeVar("T")


class Breaker:
    """Shared by a client's lanes: what the cluster's last answer said, and the fail-fast window after a failure.

    `up` is the outcome of the last evidence: a call that got an answer, or a probe that ran out of time (a
    data call that ran out of time only `suspect`s, which wakes the prober). The link's prober keeps that
    evidence at most `probe_s` old on an idle node. Once down, calls fail at once for `retry_s`, then one is
    let through; it stays down until a call succeeds.
    """

    def __init__(self, retry_s: float) -> None:
        self.retry_s = retry_s
        self._down_until = 0.0
        self._healthy = True  # set up against a master that answered: up until a call says otherwise
        self._answered_at = time.monotonic()
        self.why = ""  # why the last failure failed ("" while up)
        self._lock = threading.Lock()
        self.wake = threading.Event()  # set by `suspect`: the prober probes now instead of at its next turn

    @property
    def up(self) -> bool:
        return self._healthy

    @property
    def quiet_s(self) -> float:
        """Seconds since a call last got an answer (or ran out of time): how stale `up` is."""
        return time.monotonic() - self._answered_at

    def check(self, what: str) -> None:
        """Raise while down; once the wait is over, let exactly one caller through to probe."""
        with self._lock:
            now = time.monotonic()
            if now < self._down_until:
                raise ClusterUnavailable(f"cluster marked down: {what} not attempted")
            if self._down_until:
                self._down_until = now + self.retry_s  # the probe's window: others keep failing fast meanwhile

    def failed(self, why: str = "a call failed") -> None:
        with self._lock:
            self._answered_at = time.monotonic()
            self._down_until = self._answered_at + self.retry_s
            self._healthy = False
            self.why = why

    def suspect(self) -> None:
        """A data call got no answer in time: not evidence by itself (a loaded host is slow, not down), so the
        prober is asked to probe now; its answer, or its lack of one, decides."""
        self.wake.set()

    def succeeded(self) -> None:
        with self._lock:
            self._answered_at = time.monotonic()
            self._down_until = 0.0
            self._healthy = True
            self.why = ""


class Lane:
    """One worker thread; at most one call in flight, each bounded by its caller's deadline. A timeout is a
    miss for that call and a `suspect` (see Breaker), never by itself a dead cluster."""

    def __init__(self, name: str, breaker: Breaker) -> None:
        self.name = name
        self._breaker = breaker
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvtier-cluster-{name}")

    @contextlib.contextmanager
    def hold(self, deadline: float) -> Iterator[Calls]:
        """Own the lane (and its buffers) until the block ends; yields `Calls` bounded by `deadline` (monotonic):
        `run(fn)`, or `start(fn)` then `wait(future)` to overlap the worker's next call with the caller's work."""
        self._breaker.check(self.name)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._breaker.suspect()
            raise ClusterUnavailable(f"cluster {self.name}: an earlier call is still running past its deadline")
        calls = Calls(self.name, self._pool, self._breaker, deadline)
        try:
            yield calls
        finally:
            # A call still running (past its deadline, or started and never waited for) keeps the lane, and the
            # buffers it writes into, until it returns. The worker runs calls in order: the last one ends last.
            live = [f for f in calls.started if not f.done()]
            if live:
                live[-1].add_done_callback(lambda _f: self._lock.release())
            else:
                self._lock.release()

    def close(self, deadline: float) -> bool:
        """Take no more calls; wait until `deadline` (monotonic) for one still running. True when none runs."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        self._lock.release()
        return True


class Calls:
    """The calls of one `Lane.hold`: each runs on the lane's worker, its result awaited until the hold's deadline."""

    def __init__(self, name: str, pool: ThreadPoolExecutor, breaker: Breaker, deadline: float) -> None:
        self.name = name
        self._pool = pool
        self._breaker = breaker
        self.deadline = deadline
        self.started: list[Future] = []

    def start(self, fn: Callable[[], T]) -> Future:
        """Queue `fn` on the worker; its future, to `wait` for."""
        try:
            fut = self._pool.submit(fn)
        except RuntimeError:  # closed: the client is going away
            raise ClusterUnavailable(f"cluster {self.name}: closed") from None
        self.started.append(fut)
        return fut

    def wait(self, fut: Future[T]) -> T:
        try:
            return fut.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except FutureTimeout:
            self._breaker.suspect()
            raise ClusterUnavailable(f"cluster {self.name}: no answer within the deadline") from None

    def __call__(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the worker and return its result."""
        return self.wait(self.start(fn))


class Probes:
    """The health check's calls, each bounded by its deadline: one that gets no answer in time marks the cluster
    down (the evidence a stopped or unreachable master gives), and they run while it is marked down.

    A probe writes into no buffer, so one still running past its deadline holds nothing, and the next probe runs
    beside it on another thread (at most `at_once` at a time; beyond that the cluster is down). That matters when
    the master comes back: a call made while it was gone can sit in the client's reconnect for seconds, and a
    probe queued behind it would keep saying "down" all that while."""

    def __init__(self, breaker: Breaker, at_once: int = 4) -> None:
        self._breaker = breaker
        self._at_once = at_once
        self._pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="kvtier-cluster-probe")
        self._live: list[Future] = []
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T], deadline: float) -> T:
        """`fn()` on a probe thread; ClusterUnavailable, the cluster marked down, without an answer by `deadline`."""
        with self._lock:
            self._live = [f for f in self._live if not f.done()]
            if len(self._live) >= self._at_once:
                why = f"probe: {len(self._live)} earlier probes still wait for an answer"
                self._breaker.failed(why)
                raise ClusterUnavailable(f"cluster {why}")
            try:
                fut = self._pool.submit(fn)
            except RuntimeError:  # closed: the client is going away
                raise ClusterUnavailable("cluster probe: closed") from None
            self._live.append(fut)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self._breaker.failed("probe: no answer within the deadline")
            raise ClusterUnavailable("cluster probe: no answer within the deadline") from None

    def close(self, deadline: float) -> bool:
        """Take no more probes; wait until `deadline` (monotonic) for those still running. True when none runs."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            live = list(self._live)
        _, running = wait(live, timeout=max(0.0, deadline - time.monotonic()))
        return not running
