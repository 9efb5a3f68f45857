"""The `<socket>.starting` marker: `kvtier serve` writes it before it allocates its pools and removes it once it
listens, so `kvtier status` can say "starting" (exit 5) rather than "no daemon" in between.

The marker is only a claim: status believes it while the process it names is alive, is a `kvtier serve`, and
started when the marker says (a reused pid is someone else). A marker left by a killed daemon is ignored.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True)
class Starting:
    pid: int
    since_s: float  # seconds since the daemon began to start


def marker_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".starting")


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): a pid's identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def write_marker(socket_path: Path) -> None:
    """Claim "starting" for this process (replaced atomically: a reader never sees half a marker)."""
    pid = os.getpid()
    tmp = marker_path(socket_path).with_suffix(f".{pid}.tmp")
    tmp.write_text(f"{pid} {_start_ticks(pid)} {time.time():.3f}\n")
    tmp.replace(marker_path(socket_path))


def clear_marker(socket_path: Path) -> None:
    """Remove the marker if it is this process's own (another daemon's start is not ours to end)."""
    path = marker_path(socket_path)
    try:
        if path.read_text().split()[0] == str(os.getpid()):
            path.unlink()
    except (OSError, IndexError):
        pass


def starting(socket_path: Path) -> Starting | None:
    """The daemon starting on this socket, checked against the live process; None when there is none."""
    try:
        pid_s, ticks, since = marker_path(socket_path).read_text().split()
        pid = int(pid_s)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if _start_ticks(pid) != ticks or b"serve" not in argv:
        return None
    return Starting(pid, max(0.0, time.time() - float(since)))
