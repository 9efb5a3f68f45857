"""Per-tier counters: cheap to bump from any thread, read as one typed snapshot (metrics, `kvtier status`)."""

from __future__ import annotations

import bisect
import threading

import msgspec

# Seconds; the last bucket is everything slower. Loopback lookups land in the first few, a dead master in the last.
LATENCY_BOUNDS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram(msgspec.Struct, frozen=True):
    """Counts per latency bucket (`bounds[i]` is bucket i's upper edge; one more bucket for the rest)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float

    @property
    def total(self) -> int:
        return sum(self.counts)


class ClusterStats(msgspec.Struct, frozen=True):
    """The cluster tier since start. `misses` counts objects by why they were not served (see docs/cluster.md)."""

    up: bool  # connected, and the last call or probe (at most probe_s old on an idle node) was answered
    lookups: int  # objects asked about by has()
    found: int  # of those, present in the cluster
    hits: int  # objects loaded and verified
    misses: dict[str, int]
    bytes_loaded: int
    stored: int  # objects put
    bytes_stored: int
    put_failed: int
    removed: int
    lookup_latency: Histogram
    load_latency: Histogram
    why_down: str = ""  # while not up: what the last failure was (or that it never connected)


class ChainStats(msgspec.Struct, frozen=True):
    """The tier chain (local disk, then cluster) since start; `cluster` is the cluster tier's own record."""

    local_hits: int  # objects has()/load_into() served from local disk
    cluster_hits: int  # objects served from the cluster
    queued: int  # write-through and promotion jobs accepted
    dropped: int  # refused because the backlog was full (or the cluster down): counted, never blocking
    written_through: int
    promoted: int
    background_failed: int
    backlog_bytes: int
    cluster: ClusterStats


class LatencyRecorder:
    """A thread-safe histogram being filled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(LATENCY_BOUNDS) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(LATENCY_BOUNDS, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> Histogram:
        with self._lock:
            return Histogram(LATENCY_BOUNDS, tuple(self._counts), self._sum)


class Counters:
    """Named integer counters under one lock; `misses` is a labelled family."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)
        self._misses: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def miss(self, label: str, n: int = 1) -> None:
        with self._lock:
            self._misses[label] = self._misses.get(label, 0) + n

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def misses(self) -> dict[str, int]:
        with self._lock:
            return dict(self._misses)
