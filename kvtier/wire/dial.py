"""Connecting to the daemon's socket, with errors that say what happened: no daemon, busy, or permission denied.

A full listen backlog answers a non-blocking connect with EAGAIN: that is a daemon behind on accepting, not
a missing one, so it is retried until the caller's timeout and then reported as busy.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.wire import errors as E

_NO_DAEMON = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR)
_DENIED = (errno.EACCES, errno.EPERM)
_RETRY_S = (0.001, 0.01)  # first and longest pause between connect attempts on a full backlog


def _name(lookup: Callable[[int], Sequence[Any]], ident: int) -> str:
    try:
        return lookup(ident)[0]
    except KeyError:
        return str(ident)


def group_names(gids: tuple[int, ...] | list[int]) -> list[str]:
    return [_name(grp.getgrgid, g) for g in gids]


def access_hint(path: Path) -> str:
    """Who may open `path` (the socket, or the first directory on its way we cannot search): owner, group, mode."""
    for where in (path, *path.parents):
        try:
            st = os.stat(where)
        except PermissionError:
            continue
        except OSError:
            break
        if where != path and os.access(where, os.X_OK):
            break
        mode = stat.filemode(st.st_mode)
        group = _name(grp.getgrgid, st.st_gid)
        return (
            f"{where} is {mode} {_name(pwd.getpwuid, st.st_uid)}:{group}; join group {group!r}"
            f" (then log in again) or run as its owner"
        )
    return "check the socket's and its directory's owner, group and mode"


def dial(path: Path, timeout_s: float | None) -> socket.socket:
    """A connected unix stream socket (with `timeout_s` set), or DaemonUnavailable / DaemonBusy / PermissionDenied."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = _RETRY_S[0]
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            return sock
        except OSError as exc:
            sock.close()
            code = exc.errno
            if code in _NO_DAEMON or isinstance(exc, (FileNotFoundError, ConnectionRefusedError)):
                raise E.DaemonUnavailable(
                    f"no kvtier daemon on {path} ({exc.strerror}); start one with `kvtier serve`"
                ) from None
            if code in _DENIED:
                raise E.PermissionDenied(f"permission denied on {path}: {access_hint(path)}") from None
            if code != errno.EAGAIN and not isinstance(exc, TimeoutError):
                raise E.DaemonUnavailable(f"cannot connect to the kvtier daemon on {path}: {exc}") from None
            if deadline is not None and time.monotonic() + pause > deadline:
                raise E.DaemonBusy(
                    f"the kvtier daemon on {path} is busy: its listen backlog stayed full for {timeout_s}s; retry later"
                ) from None
        time.sleep(pause)  # backoff between connect attempts while the backlog is full
        pause = min(pause * 2, _RETRY_S[1])
