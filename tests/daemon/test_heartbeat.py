"""The client's lease heartbeat never outlives its client: close() joins it, and it holds the client only weakly
(a heartbeat that dropped the last reference freed the client's mapped pool tensors on its own thread, which at
interpreter exit aborted the engine process: SIGABRT, "terminate called without an active exception")."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest

from kvtier.client import Client
from support.daemon import DaemonProc


def test_close_waits_for_a_renewal_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat held inside a renewal: close() does not return before it does, and then it is gone."""
    d = DaemonProc(tmp_path, top_toml="lease_ttl_s = 1\n")  # a renewal every third of a second
    entered, release = threading.Event(), threading.Event()
    renew = Client.renew

    def held(self: Client) -> int:
        if threading.current_thread().name == "kvtier-heartbeat":
            entered.set()
            release.wait()
        return renew(self)

    monkeypatch.setattr(Client, "renew", held)
    try:
        c = Client(d.socket)
        c.attach("ref-tiny")
        beat = c._beat
        assert beat is not None and entered.wait(30)
        closer = threading.Thread(target=c.close)
        closer.start()
        closer.join(0.5)
        assert closer.is_alive()  # waiting for the renewal (returned at once before close() joined the heartbeat)
        release.set()
        closer.join(30)
        assert not closer.is_alive() and not beat.is_alive()
    finally:
        release.set()
        d.terminate()


def test_the_heartbeat_does_not_keep_a_dropped_client_alive_and_stops_with_it(daemon: DaemonProc) -> None:
    c = Client(daemon.socket)
    c.attach("ref-tiny")
    beat, ref = c._beat, weakref.ref(c)
    assert beat is not None and beat.is_alive()
    del c
    gc.collect()
    assert ref() is None
    beat.join(timeout=30)
    assert not beat.is_alive()
