"""The threads that serve connections: started as the number of connections at once grows, then kept.

Contract (`Workers(target, name)`):
- `submit(*args)` runs `target(*args)` on a worker thread and returns at once: on an idle worker if there is
  one, else on a thread started for it. Every submitted call runs; none waits for another to finish.
- Workers are daemon threads and never end: there are at most as many as calls were ever running at once (for
  the server: about `max_connections`, plus the connections closed and not yet seen out by their threads).
- If `target` raises, its worker ends (threading.excepthook reports it, as for any thread); later calls start
  another.

Why not a thread per connection: `Thread.start()` returns only once the new thread has run, and under load that
waits for it to win the GIL from the busy connection threads; the accept loop waited so for every connection
(see `kvtier.daemon.silent_connections` for what that cost under a flood of connects). A worker reused for the next
connection starts nothing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Workers:
    """Connection threads (see the module docstring for the contract)."""

    def __init__(self, target: Callable[..., None], name: str) -> None:
        self._target = target
        self._name = name
        self._calls: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def submit(self, *args: Any) -> None:
        with self._lock:
            start = not self._idle
            if start:
                self._started += 1
                number = self._started
            else:
                self._idle -= 1  # that worker's next call is this one
        self._calls.put(args)
        if start:
            threading.Thread(target=self._work, name=f"{self._name}-{number}", daemon=True).start()

    @property
    def started(self) -> int:
        """Worker threads started so far."""
        with self._lock:
            return self._started

    @property
    def idle(self) -> int:
        """Workers done with their last call and not yet given another."""
        with self._lock:
            return self._idle

    def _work(self) -> None:
        while True:
            self._target(*self._calls.get())
            with self._lock:
                self._idle += 1
