"""The daemon's life under a service manager: READY, periodic WATCHDOG, SIGHUP reload, SIGTERM -> STOPPING and
exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.client import Client
from kvtier.store import DiskStore, StoreConfig
from support.daemon import DaemonProc, child_env


@pytest.mark.parametrize("abstract", [False, True], ids=["path-socket", "abstract-socket"])
def test_ready_watchdog_stopping(tmp_path: Path, abstract: bool) -> None:
    d = DaemonProc(tmp_path, abstract_notify=abstract, watchdog_usec=200_000)  # ping every 0.1 s
    try:
        ready = next(m for m in d.messages if "READY=1" in m.split("\n"))
        assert f"MAINPID={d.proc.pid}" in ready and "STATUS=serving on" in ready
        for _ in range(3):
            d.wait_for("WATCHDOG=1", timeout=5)
        d.proc.send_signal(signal.SIGTERM)
        d.wait_for("STOPPING=1", timeout=10)
        assert d.proc.wait(20) == 0
    finally:
        d.close()


def test_sigterm_with_clients_connected_exits_0_within_bound(daemon: DaemonProc) -> None:
    idle = Client(daemon.socket)
    attached = Client(daemon.socket)
    attached.attach("ref-tiny")
    started = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(20) == 0
    assert time.monotonic() - started < 15
    assert not daemon.socket.exists()  # stopped accepting: the socket is gone
    idle.close()
    attached.close()


# The refused second daemon and then the reload (which ends it) share one daemon (`shared_daemon`): the first only
# reads it, and runs before the reload in the file's order (the order a worker runs a module's tests in).


def test_second_daemon_on_a_live_socket_is_refused(shared_daemon: DaemonProc) -> None:
    daemon = shared_daemon
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(daemon.config)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        out.returncode == 2 and "another daemon is serving" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    )
    with Client(daemon.socket) as c:  # the first one is untouched
        assert c.stats().daemon.health == "ok"


def test_sighup_reloads_quotas_and_rates(shared_daemon: DaemonProc) -> None:
    """Last on the module's daemon: it rewrites the config (broken, at the end) and stops the daemon."""
    daemon = shared_daemon
    with Client(daemon.socket) as c:
        before = c.stats().reloadable
    text = daemon.config.read_text().replace('budget_bytes = "256MiB"', 'budget_bytes = "300MiB"')
    daemon.config.write_text(text.replace('mode = "off"', 'mode = "off"\nrate_bytes_per_s = "5MiB"'))
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_for("RELOADING=1")
    reloaded = daemon.wait_for("READY=1")
    assert "reloaded" in reloaded
    with Client(daemon.socket) as c:
        doc = c.stats()
    after = doc.reloadable
    assert before.store_budget_bytes == 256 * 2**20 and after.store_budget_bytes == 300 * 2**20
    assert doc.store["budget_bytes"] == 300 * 2**20  # the store itself enforces the new budget
    with DiskStore(str(daemon.tmp / "store"), StoreConfig(io_backend="buffered"), readonly=True) as s:
        assert s.limits().budget_bytes == 300 * 2**20  # and published it for the verifier and audit
    assert after.verifier_rate_bytes_per_s == 5 * 2**20
    # a broken config on reload keeps the running one, and says so
    daemon.config.write_text(text.replace('mode = "off"', 'mode = "off"\nrate_bytes_per_s = -1'))
    daemon.proc.send_signal(signal.SIGHUP)
    failed = daemon.wait_for("READY=1")
    assert "reload failed" in failed and "verifier.rate_bytes_per_s" in failed
    with Client(daemon.socket) as c:
        assert c.stats().reloadable.verifier_rate_bytes_per_s == 5 * 2**20
    assert daemon.terminate() == 0
