"""Moving cpu pools onto huge pages after they are made (MADV_COLLAPSE), on a thread that never holds up a load.

Contract:
- `PageMove(start, size, memory)` is one pool's move: its memfd mapped at `start` (aligned to 2 MiB), `size` bytes
  (whole 2 MiB ranges), `memory` the object that keeps that mapping (the pool's tensor over it). `run()` asks the
  kernel to move each 2 MiB range onto a huge page, in address order, and counts `tried` and `moved` bytes as it
  goes; `left` is what is not tried yet (0 once it has run). A range the kernel refuses (no huge page to be had, a
  read in flight into it) stays on small pages: served the same, read in smaller requests.
- `start_moving(label, moves)` returns at once: a daemon thread at the lowest CPU priority runs the moves (the
  pools' `Pool.move`, set where `kvtier.core.hugepages.shared_pages` chose COLLAPSE) one after another, and logs one
  line at the end. Each move holds its memory, so the pools stay mapped while it runs. None where there is none.
- The pools serve throughout and their bytes never change: the kernel copies a range only while no one holds its
  pages, and a process touching it meanwhile (through any mapping of the memfd, an engine's read-only one included)
  waits for the copy, then sees the huge page.

Why after, not when the pool is made: the move copies every page and may first compact memory to find huge ones,
seconds per GiB on a busy host; a daemon's start (and its READY to systemd) does not wait for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence

from kvtier.core import hugepages

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class PageMove:
    """One pool's move onto huge pages (the module docstring states the contract)."""

    start: int
    size: int
    memory: object = dataclasses.field(repr=False)  # (kept: the mapping outlives the move)
    tried: int = 0
    moved: int = 0

    @property
    def left(self) -> int:
        return self.size - self.tried

    def run(self) -> None:
        for at in range(self.start + self.tried, self.start + self.size, hugepages.HUGE_PAGE):
            if hugepages.collapse(at, hugepages.HUGE_PAGE):
                self.moved += hugepages.HUGE_PAGE
            self.tried += hugepages.HUGE_PAGE


def start_moving(label: str, moves: Sequence[PageMove]) -> threading.Thread | None:
    """Run `moves` on a thread of their own (the module docstring states the contract)."""
    if not moves:
        return None

    def run(moves: tuple[PageMove, ...]) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # (a thread's own nice value: Linux)
        began = time.monotonic()
        for move in moves:
            move.run()
        moved, total = sum(m.moved for m in moves), sum(m.size for m in moves)
        log.info(
            "%s pools: %d of %d MiB moved onto huge pages in %.1f s (MADV_COLLAPSE)%s",
            label,
            moved >> 20,
            total >> 20,
            time.monotonic() - began,
            "" if moved == total else "; the rest stays on small pages (no huge page to be had, or in use)",
        )

    thread = threading.Thread(target=run, args=(tuple(moves),), name=f"kvtier-page-move-{label}", daemon=True)
    thread.start()
    return thread
