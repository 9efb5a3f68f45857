"""A process's state as the kernel reports it now, for tests that wait on other processes (stopped, gone)."""

from __future__ import annotations

from pathlib import Path


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat ("R", "S", "T" stopped, "Z" zombie...), or None once the pid is gone.
    Read after the last ")": the command name before it may hold spaces and parentheses."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def ended(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its parent has yet to reap)."""
    return process_state(pid) in (None, "Z")
