"""Connections that have not spoken yet: the lobby's order and hand-out on socket pairs, then a real daemon closing
silent connections at hello_timeout_s, making room at max_connections with the oldest silent one (a greeted one
never), and ending them at SIGTERM without waiting out the shutdown deadline."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from kvtier.daemon.session import Peer, Session
from kvtier.daemon.silent_connections import Lobby
from kvtier.wire import Connection
from support.daemon import DaemonProc

HELLO_S = 1.0


def test_lobby_hands_out_speakers_expires_in_arrival_order_and_picks_the_oldest_silent_victim() -> None:
    pairs = [socket.socketpair() for _ in range(4)]
    lobby = Lobby(hello_timeout_s=5.0)
    try:
        for owner, (ours, _) in enumerate(pairs):
            lobby.enter(owner, ours, Session(owner, Peer(0, 0, 0)), now=float(owner))
        assert lobby.ready() == ([], []) and lobby.due(0.0) == 5.0
        pairs[1][1].sendall(b"\x00")  # owner 1 speaks
        pairs[3][1].close()  # owner 3's peer leaves: readable too (EOF)
        spoken, gone = lobby.ready()
        assert [w.owner for w in spoken] == [1] and [w.owner for w in gone] == [3]
        assert [w.owner for w in lobby.expired(5.5)] == [0]  # deadline 5.0; owner 2's is 7.0
        assert lobby.due(5.5) == 1.5
        assert lobby.victim().owner == 2 and lobby.victim() is None and len(lobby) == 0
    finally:
        lobby.close()
        for a, b in pairs:
            a.close()
            b.close()


def _daemon(tmp: Path, hello_s: float) -> DaemonProc:
    return DaemonProc(tmp, server_toml=f"max_connections = 3\nhello_timeout_s = {hello_s}\n")


def _silent(d: DaemonProc) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(d.socket))
    s.settimeout(10.0)
    return s


def test_silent_connections_close_at_their_hello_time_and_make_room_oldest_first(tmp_path: Path) -> None:
    d = _daemon(tmp_path, HELLO_S)
    try:
        first = _silent(d)
        opened = time.monotonic()
        assert first.recv(1) == b""  # closed by the daemon: nothing was ever owed to it
        waited = time.monotonic() - opened
        assert HELLO_S * 0.9 <= waited < HELLO_S + 3.0, waited  # at its time, not at some later sweep
        first.close()

        with Connection(d.socket, timeout_s=5) as greeted:  # 1 of 3 slots, greeted: never a victim
            old, new = _silent(d), _silent(d)  # 3 of 3, accepted in this order
            with Connection(d.socket, timeout_s=5) as late:  # at the cap: the oldest silent one makes room
                assert late.stats().daemon.health == "ok"
                assert old.recv(1) == b""
            assert greeted.stats().daemon.health == "ok"
            new.close()
            old.close()
    finally:
        d.close()


def test_sigterm_ends_silent_connections_at_once(tmp_path: Path) -> None:
    d = _daemon(tmp_path, 60.0)  # longer than the shutdown: only the drain can close it
    waiting = _silent(d)
    with Connection(d.socket, timeout_s=5) as c:  # the silent one was accepted first: it is in the lobby
        assert c.stats().daemon.connections == 2
    started = time.monotonic()
    assert d.terminate(timeout=60) == 0
    assert time.monotonic() - started < 15.0  # the shutdown deadline is 20 s: nothing waited it out
    assert waiting.recv(1) == b""
    waiting.close()
    log = (tmp_path / "daemon.log").read_text()  # (terminate closed the daemon's log)
    assert "Traceback" not in log and "still busy" not in log and "stopped cleanly" in log
