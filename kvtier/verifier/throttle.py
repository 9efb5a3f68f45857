"""A token bucket in bytes per second, interruptible by the stop event."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    """Allows `rate` bytes/s with a one-second burst; a take larger than the bucket runs into debt and waits it off."""

    def __init__(self, rate_bytes_per_s: int, stop: threading.Event) -> None:
        self.rate = rate_bytes_per_s
        self._stop = stop
        self._tokens = float(rate_bytes_per_s)
        self._last = time.monotonic()

    def set_rate(self, rate_bytes_per_s: int) -> None:
        self.rate = rate_bytes_per_s
        self._tokens = min(self._tokens, float(rate_bytes_per_s))

    def take(self, nbytes: int) -> bool:
        """Wait until `nbytes` may be read; False if the verifier is stopping."""
        if self.rate <= 0:
            return not self._stop.is_set()
        now = time.monotonic()
        self._tokens = min(float(self.rate), self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens >= 0:
            return not self._stop.is_set()
        return not self._stop.wait(-self._tokens / self.rate)
