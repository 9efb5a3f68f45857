"""A token bucket in bytes per second, interruptible by the stop event."""

from __future__ import annotations

import threading
import time

BURST_S = 0.1  # the bucket holds this many seconds of the rate


class RateLimiter:
    """Allows `rate` bytes/s with a burst of BURST_S seconds' worth; a take larger than the bucket runs into debt and
    waits it off. The burst is short because whatever the verifier saved up while idle or paused it would read
    back to back at disk speed the moment it resumes: a one-second bucket let a resumed verifier read a second's
    worth of bytes at once, which is when the store's readers queue behind it."""

    def __init__(self, rate_bytes_per_s: int, stop: threading.Event) -> None:
        self.rate = rate_bytes_per_s
        self._stop = stop
        self._tokens = self._capacity()
        self._last = time.monotonic()

    def _capacity(self) -> float:
        return self.rate * BURST_S

    def set_rate(self, rate_bytes_per_s: int) -> None:
        self.rate = rate_bytes_per_s
        self._tokens = min(self._tokens, self._capacity())

    def take(self, nbytes: int) -> bool:
        """Wait until `nbytes` may be read; False if the verifier is stopping."""
        if self.rate <= 0:
            return not self._stop.is_set()
        now = time.monotonic()
        self._tokens = min(self._capacity(), self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens >= 0:
            return not self._stop.is_set()
        return not self._stop.wait(-self._tokens / self.rate)
