"""A process's state as the kernel reports it now, for tests that wait on other processes (stopped, gone)."""

from __future__ import annotations

import os
from pathlib import Path


def _state(stat: Path) -> str | None:
    """The state letter of a /proc stat file, read after the last ")" (the command name before it may hold spaces
    and parentheses); None once the process or thread is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat ("R", "S", "T" stopped, "Z" zombie...), or None once the pid is gone."""
    return _state(Path(f"/proc/{pid}/stat"))


def all_threads_stopped(pid: int) -> bool:
    """Every thread of the process reads stopped ("T", or "t" under a tracer): a SIGSTOP has taken effect, not only
    been sent (a thread in the kernel stops on its way out). False once the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    states = [_state(Path(f"/proc/{pid}/task/{tid}/stat")) for tid in tids]
    return all(state is None or state in "tT" for state in states)  # (None: a thread that ended meanwhile)


def ended(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its parent has yet to reap)."""
    return process_state(pid) in (None, "Z")
