"""A real `kvtier serve` process on a temporary socket, with a datagram socket standing in for systemd's.

It is forked from the worker's warm server (`support.warm_start`: torch and kvtier already imported) unless
`fresh=True` asks for a fresh interpreter, as systemd starts one: the tests of the daemon's start-up ask for that.

Shared by the daemon, CLI and e2e tests (import as `support.daemon`; pyproject puts `tests/` on the path).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from support.warm_start import WarmProc

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    env.update(extra)
    return env


# Pools of a few dozen ref-tiny blocks, so that eviction is easy to force.
SMALL_POOLS = 'compressed = "64KiB"\nindexer = "16KiB"\ntail = "64KiB"\nswa = "128KiB"\n'


class DaemonProc:
    """A running daemon: its process, socket, config file and the notify socket it reports to."""

    def __init__(
        self,
        tmp: Path,
        *,
        extra_toml: str = "",
        server_toml: str = "",
        socket_path: Path | None = None,
        abstract_notify: bool = False,
        watchdog_usec: int | None = None,
        pools: str = 'compressed = "2MiB"\nindexer = "1MiB"\ntail = "2MiB"\nswa = "2MiB"\n',
        profiles: tuple[str, ...] = ("ref-tiny",),
        store_root: Path | None = None,
        top_toml: str = "",
        verifier: str = 'mode = "off"\n',
        env: dict[str, str] | None = None,
        wait_ready: bool = True,
        fresh: bool = False,
    ) -> None:
        self.tmp = tmp
        self.socket = socket_path or tmp / "kvtier.sock"
        self.config = tmp / "kvtier.toml"
        self.config.write_text(
            f'device = "cpu"\nprofiles = {json.dumps(list(profiles))}\nshutdown_timeout_s = 20\n{top_toml}'
            f'[server]\nsocket = "{self.socket}"\nframe_timeout_s = 1.0\n{server_toml}'
            f'[store]\nroot = "{store_root or tmp / "store"}"\nbudget_bytes = "256MiB"\n'
            f"[pool.budget_bytes]\n{pools}"
            f'[verifier]\n{verifier}[metrics]\naddress = "127.0.0.1:0"\n' + extra_toml
        )
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract_notify:
            name = f"kvtier-test-{uuid.uuid4().hex}"
            self.notify.bind("\0" + name)
            notify_addr = "@" + name
        else:
            notify_addr = str(tmp / "notify.sock")
            Path(notify_addr).unlink(missing_ok=True)  # left by an earlier daemon of the same test
            self.notify.bind(notify_addr)
        env = child_env(NOTIFY_SOCKET=notify_addr, **(env or {}))
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        self.log = open(tmp / "daemon.log", "wb")  # noqa: SIM115  (the daemon writes it until close())
        argv = ["-v", "serve", "--config", str(self.config)]
        self.proc: subprocess.Popen[bytes] | WarmProc
        if fresh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli", *argv], env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp
            )
        else:
            self.proc = WarmProc(argv, env=env, cwd=tmp, out=tmp / "daemon.log")
        self.messages: list[str] = []
        if wait_ready:  # READY=1 comes once the pools are ready (the socket serves the store before that)
            try:
                self.wait_for("READY=1", timeout=60)
            except BaseException:
                self.close()  # the caller never gets this object to close: a daemon left here outlives the test
                raise

    def recv_notify(self, timeout: float) -> str | None:
        self.notify.settimeout(timeout)
        try:
            msg = self.notify.recv(4096).decode()
        except TimeoutError:
            return None
        self.messages.append(msg)
        return msg

    def wait_for(self, line: str, timeout: float = 20.0) -> str:
        """Block until a notify datagram carrying `line` arrives (or fail, with the daemon's log)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"no {line!r} from the daemon (exit {self.proc.poll()}); log:\n{self.read_log()}")
            msg = self.recv_notify(min(remaining, 0.5))
            if msg is not None and line in msg.split("\n"):
                return msg

    def read_log(self) -> str:
        self.log.flush()
        return (self.tmp / "daemon.log").read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        self.log.close()


def wait_leases_released(socket_path: Path, timeout_s: float = 20.0) -> None:
    """Poll the daemon's stats until no lease is live: a dead client's are released on its disconnect."""
    from kvtier.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(socket_path) as c:
        while c.stats().profiles[0].live_leases:
            assert time.monotonic() < deadline, "the dead client's leases were never released"
            time.sleep(0.02)  # polling interval of a real condition, not synchronisation
