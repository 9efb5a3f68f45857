"""sd_notify without a package: READY / STATUS / WATCHDOG / STOPPING datagrams to `$NOTIFY_SOCKET` (path or `@`)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Talks to the service manager; does nothing when not started by one (no `$NOTIFY_SOCKET`)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = ("\0" + addr[1:]) if addr.startswith("@") else (addr or None)
        self.watchdog_interval_s = self._watchdog_interval(env)
        self._next_ping = 0.0
        self._sock: socket.socket | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @staticmethod
    def _watchdog_interval(env: Mapping[str, str]) -> float | None:
        """Half of `$WATCHDOG_USEC` when the watchdog is meant for this process (`$WATCHDOG_PID` unset or ours)."""
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 2e6

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        """Send one datagram of `KEY=value` lines; False (logged) if the manager is unreachable."""
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *((f"STATUS={status}",) if status else ()), f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1")

    def watchdog_due(self, now: float | None = None) -> float | None:
        """Seconds until the next WATCHDOG=1 is due (0 if now); None when there is no watchdog."""
        if self.watchdog_interval_s is None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self._next_ping - now)

    def ping_watchdog(self, now: float | None = None) -> None:
        """WATCHDOG=1 if half the watchdog interval has passed since the last one."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic() if now is None else now
        if now >= self._next_ping:
            self.notify("WATCHDOG=1")
            self._next_ping = now + self.watchdog_interval_s

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
