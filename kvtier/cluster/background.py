"""The chain's background writer: write-through to the cluster and promotion to local disk, never blocking a caller.

Jobs wait in a queue bounded by bytes; a job that does not fit is dropped and counted (an offload's
copy in the cluster is an optimisation, never a promise). One worker thread runs them in order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvtier.cluster.bytes_copy import cpu_copy
from kvtier.cluster.stats import Counters
from kvtier.core.errors import KvtierError
from kvtier.core.tier import ObjectKey

log = logging.getLogger(__name__)

Items = Sequence[tuple[ObjectKey, torch.Tensor, bytes]]


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    kind: str  # a counter name: "written_through" or "promoted"
    run: Callable[[Items], None]
    items: Items
    nbytes: int


class BackgroundWriter:
    """A bounded backlog of store_many calls, run by one thread; `counters` gets queued/dropped/<kind>/failed."""

    def __init__(self, max_bytes: int, counters: Counters) -> None:
        self.max_bytes = max_bytes
        self._counters = counters
        self._jobs: deque[_Job] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="kvtier-cluster-writer", daemon=True)
        self._thread.start()

    @property
    def backlog_bytes(self) -> int:
        return self._bytes

    def submit(self, kind: str, run: Callable[[Items], None], items: Items) -> bool:
        """Queue CPU copies of `items` for `run`; False (counted as dropped) when the backlog is full."""
        nbytes = sum(p.numel() for _, p, _ in items)
        with self._cond:
            if self._closed or self._bytes + nbytes > self.max_bytes:
                self._counters.add("dropped", len(items))
                return False
            self._bytes += nbytes
        # Copies outside the lock: the caller's tensors are pool slots that may be reused once it returns. By
        # numpy in this thread (bytes_copy): torch's copy stalls on busy cores, and this runs inside a load.
        copies = [(k, cpu_copy(p), d) for k, p, d in items]
        with self._cond:
            self._jobs.append(_Job(kind, run, copies, nbytes))
            self._counters.add("queued", len(items))
            self._cond.notify()
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job.run(job.items)
                self._counters.add(job.kind, len(job.items))
            except (
                KvtierError,
                OSError,
                ValueError,
            ) as exc:  # a failed copy is counted; the caller was answered long ago
                log.info("background %s of %d objects failed: %s", job.kind, len(job.items), exc)
                self._counters.add("background_failed", len(job.items))
            finally:
                with self._cond:
                    self._bytes -= job.nbytes
                    self._busy = False
                    self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job has run; False if the timeout came first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self, timeout: float) -> None:
        """Run what is queued (up to `timeout`), then stop; what is left is dropped and counted."""
        self.drain(timeout)
        with self._cond:
            self._closed = True
            left = sum(len(j.items) for j in self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        if left:
            self._counters.add("dropped", left)
        self._thread.join(timeout=1.0)
