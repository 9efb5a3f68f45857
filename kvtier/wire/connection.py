"""One connection to the kvtier daemon: framing, hello, request/reply, typed errors. No torch: `kvtier status`
uses it alone; `kvtier.client.Client` and `TierClient` build on it."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

from kvtier.core.errors import KvtierError, NotDurable, StaleHandle
from kvtier.wire import errors as E
from kvtier.wire import framing as F
from kvtier.wire import messages as P
from kvtier.wire.stats import StatsDoc

_ERRORS: dict[str, type[KvtierError]] = {
    cls.code: cls
    for cls in (
        E.ProtocolError,
        E.FrameTooLarge,
        E.UnknownOp,
        E.WrongType,
        E.UnsupportedVersion,
        E.OutOfOrder,
        E.PermissionDenied,
        E.DaemonBusy,
        E.BadRange,
        StaleHandle,
        NotDurable,
    )
}


def _raise(err: P.Error) -> None:
    cls = _ERRORS.get(err.code)
    raise cls(err.message) if cls is not None else E.RemoteError(err.code, err.message)


def default_socket() -> Path:
    """`$KVTIER_SOCKET`, else the socket of the config `kvtier serve` would run on here."""
    if env := os.environ.get("KVTIER_SOCKET"):
        return Path(env)
    from kvtier.core.config import load_config

    return load_config(None).server.socket


class Connection:
    """One socket to the daemon, greeted with hello; one request at a time (a lock serialises threads)."""

    def __init__(
        self, socket_path: str | Path | None = None, *, timeout_s: float | None = 60.0, name: str = ""
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else default_socket()
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(self.socket_path))
        except OSError as exc:
            self._sock.close()
            raise E.DaemonUnavailable(
                f"no kvtier daemon on {self.socket_path} ({exc.strerror}); start one with `kvtier serve`"
            ) from None
        hello = self._call(P.Hello(list(F.SUPPORTED_VERSIONS), name or f"pid {os.getpid()}"))
        assert isinstance(hello, P.HelloOk)
        self.daemon = hello.daemon

    def _call(self, req: P.Msg, fds: list[int] | None = None, *, send_fds: list[int] | None = None) -> Any:
        """Send `req` (with `send_fds` as SCM_RIGHTS) and return its reply; descriptors riding back go to `fds`."""
        with self._lock:
            try:
                try:
                    F.send_frame(self._sock, req, send_fds)
                except OSError:
                    # A daemon that refuses us (permissions, busy) answers and closes before reading:
                    # its error frame may already wait in our receive buffer.
                    pass
                reply = F.recv_reply(self._sock, fds=fds)
            except (OSError, E.DaemonUnavailable) as exc:
                raise E.DaemonUnavailable(f"lost the kvtier daemon on {self.socket_path}: {exc}") from None
        if isinstance(reply, P.Error):
            _raise(reply)
        return reply

    def stats(self) -> StatsDoc:
        reply: P.StatsOk = self._call(P.Stats())
        return reply.stats

    def close(self) -> None:
        """Disconnect; the daemon releases everything this connection held."""
        self._sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
