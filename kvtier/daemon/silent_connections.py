"""Accepted connections that have not said anything yet, watched by the accept loop instead of by a thread each.

Contract (used from the daemon's main loop only; not thread-safe):
- `enter(owner, conn, session, now)` watches a new connection until bytes (or EOF) wait on it, or
  `hello_timeout_s` passes. `fileno()` is a pollable descriptor (an epoll set) that is readable while some watched
  connection is.
- `ready()` takes out the connections with something waiting, as (spoken: bytes wait, gone: EOF or reset);
  `expired(now)` those whose hello time is up; `victim()` the oldest with no byte waiting (None if every one has
  bytes waiting); `empty()` all. A connection taken out is the caller's to serve or close; `due(now)` is the
  seconds until the next expiry.
- Connections are kept in arrival order, so the oldest silent one is the first victim.

Why: a connection that never speaks (tests/daemon/test_hostile_load.py keeps 200 open and opens more as fast
as it can) used to cost a thread started for it and woken again to close it, each waiting for a GIL held by
busy connections: on a slow two-core machine the accept loop fell so far behind that a well-formed client behind
a full listen backlog waited seconds to be greeted (docs/hardening.md). Watched here, a
silent connection costs the loop an epoll registration, and a thread only once it has spoken.
"""

from __future__ import annotations

import dataclasses
import selectors
import socket

from kvtier.daemon.session import Session


@dataclasses.dataclass(slots=True)
class Waiting:
    """One connection in the lobby: its owner number, socket, session and when its hello time is up."""

    owner: int
    conn: socket.socket
    session: Session
    deadline: float


class Lobby:
    """Silent connections (see the module docstring for the contract)."""

    def __init__(self, hello_timeout_s: float) -> None:
        self.hello_timeout_s = hello_timeout_s
        self._sel = selectors.DefaultSelector()
        self._waiting: dict[int, Waiting] = {}  # by owner, in arrival order

    def fileno(self) -> int:
        return self._sel.fileno()

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, owner: int, conn: socket.socket, session: Session, now: float) -> None:
        self._waiting[owner] = Waiting(owner, conn, session, now + self.hello_timeout_s)
        self._sel.register(conn, selectors.EVENT_READ, owner)

    def ready(self) -> tuple[list[Waiting], list[Waiting]]:
        spoken: list[Waiting] = []
        gone: list[Waiting] = []
        for key, _ in self._sel.select(0):
            w = self._take(key.data)
            # woken without a byte after all (None): its thread waits for one, within hello_timeout_s
            (gone if _peek(w.conn) == b"" else spoken).append(w)
        return spoken, gone

    def expired(self, now: float) -> list[Waiting]:
        out: list[Waiting] = []
        for w in self._waiting.values():
            if w.deadline > now:
                break  # arrival order is deadline order
            out.append(w)
        return [self._take(w.owner) for w in out]

    def due(self, now: float) -> float | None:
        first = next(iter(self._waiting.values()), None)
        return None if first is None else max(0.0, first.deadline - now)

    def victim(self) -> Waiting | None:
        for owner, w in self._waiting.items():
            if not _peek(w.conn):  # nothing waiting, or gone: as good a victim as a silent one
                return self._take(owner)
        return None

    def empty(self) -> list[Waiting]:
        return [self._take(owner) for owner in list(self._waiting)]

    def close(self) -> None:
        self._sel.close()

    def _take(self, owner: int) -> Waiting:
        w = self._waiting.pop(owner)
        self._sel.unregister(w.conn)
        return w


def _peek(conn: socket.socket) -> bytes | None:
    """The first byte waiting on the connection; b"" if its peer left (EOF, or reset); None if nothing waits yet."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b""
