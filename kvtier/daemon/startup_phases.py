"""When each phase of a `kvtier serve` start ended, in seconds since the process was started (exec, not
import): what `kvtier status --json` shows as `daemon.startup` and bench/startup.py prints.

The process's start is read from the kernel (/proc/self/stat), so the interpreter's own start-up and the
imports before the first line of kvtier's code are counted too.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def process_age_s() -> float | None:
    """Seconds since this process started (the kernel's start time on the boot clock); None where unreadable."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rpartition(")")[2].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupPhases:
    """Phase name -> seconds since the process started, in the order marked (the first mark of a name stays)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        age = process_age_s()
        if age is None:
            return
        with self._lock:
            self._marks.setdefault(name, round(age, 3))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._marks)


PHASES = StartupPhases()  # one daemon per process
