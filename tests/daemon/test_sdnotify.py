"""sd_notify datagrams reach a real datagram socket, by path and in the abstract namespace."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from kvtier.daemon.sdnotify import Notifier


def _listener(abstract: bool, tmp_path: Path) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"kvtier-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        address = "@" + name
    else:
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    sock.settimeout(5)
    return sock, address


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_messages_arrive(tmp_path: Path, abstract: bool) -> None:
    sock, address = _listener(abstract, tmp_path)
    n = Notifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000"})
    assert n.enabled and n.watchdog_interval_s == 1.0
    assert n.ready("serving")
    assert sock.recv(4096).decode().split("\n") == ["READY=1", "STATUS=serving", f"MAINPID={os.getpid()}"]
    n.ping_watchdog(now=100.0)
    assert sock.recv(4096) == b"WATCHDOG=1"
    n.ping_watchdog(now=100.5)  # not yet due: half of WATCHDOG_USEC is 1 s
    assert n.watchdog_due(now=100.5) == pytest.approx(0.5)
    n.ping_watchdog(now=101.0)
    n.stopping()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert sock.recv(4096).decode().startswith("STOPPING=1\n")
    n.close()
    sock.close()


def test_silent_without_a_manager() -> None:
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None and not n.ready()
    assert n.watchdog_due() is None


def test_watchdog_meant_for_another_pid_is_ignored() -> None:
    assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s == 0.5


def test_unreachable_manager_is_not_fatal(tmp_path: Path) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert n.enabled and not n.ready()
