"""A token bucket in bytes per second, interruptible by the stop event, slower while the disk is busy."""

from __future__ import annotations

import threading
import time
from typing import Protocol

BURST_S = 0.1  # the bucket holds this many seconds of the rate


class BusyProbe(Protocol):
    def busy(self) -> bool: ...


class RateLimiter:
    """Allows `rate` bytes/s with a burst of BURST_S seconds' worth; a take larger than the bucket runs into debt and
    waits it off. The burst is short because whatever the verifier saved up while idle or paused it would read
    back to back at disk speed the moment it resumes: a one-second bucket let a resumed verifier read a second's
    worth of bytes at once, which is when the store's readers queue behind it.

    With a `probe`, each take runs at `busy_rate` (at most `rate`) while the probe says other processes use the
    disk, else at `rate` (md's sync_speed_min / sync_speed_max); `paced_busy` says which the last take used."""

    def __init__(
        self,
        rate_bytes_per_s: int,
        stop: threading.Event,
        busy_rate_bytes_per_s: int = 0,
        probe: BusyProbe | None = None,
    ) -> None:
        self.rate = rate_bytes_per_s
        self.busy_rate = busy_rate_bytes_per_s
        self.probe = probe
        self.paced_busy = False
        self._stop = stop
        self._tokens = self.rate * BURST_S
        self._last = time.monotonic()

    def set_rate(self, rate_bytes_per_s: int, busy_rate_bytes_per_s: int) -> None:
        self.rate, self.busy_rate = rate_bytes_per_s, busy_rate_bytes_per_s
        self._tokens = min(self._tokens, self.rate * BURST_S)

    def _effective_rate(self) -> int:
        """The busy rate while the probe says busy, if it is below `rate` and not 0 (0: unlimited, so `rate`)."""
        probe = self.probe
        self.paced_busy = probe is not None and 0 < self.busy_rate < self.rate and probe.busy()
        return self.busy_rate if self.paced_busy else self.rate

    def burst(self, nbytes: int) -> int:
        """The size for one of the verifier's reads or copies of up to `nbytes`: while the disk is busy, at most a
        tenth of a second of the busy rate (about 410 KiB at 4 MiB/s; at least 1). A reader's request that reaches the
        disk behind one of those waits for all of it, so a batch of megabytes read at disk speed, however well
        paced on average, is what its p99 sees."""
        rate = self._effective_rate()
        return min(nbytes, max(1, int(rate * BURST_S))) if self.paced_busy else nbytes

    def take(self, nbytes: int) -> bool:
        """Wait until `nbytes` may be read; False if the verifier is stopping."""
        rate = self._effective_rate()
        if rate <= 0:
            return not self._stop.is_set()
        now = time.monotonic()
        self._tokens = min(rate * BURST_S, self._tokens + (now - self._last) * rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens >= 0:
            return not self._stop.is_set()
        wait = -self._tokens / rate
        self._tokens, self._last = 0.0, now + wait  # the debt is paid off at this take's rate, whatever the next one's
        return not self._stop.wait(wait)
