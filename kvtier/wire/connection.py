"""One connection to the kvtier daemon: framing, hello, request/reply, typed errors. No torch: `kvtier status`
uses it alone; `kvtier.client.Client` and `TierClient` build on it."""

from __future__ import annotations

import itertools
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any, Self

from kvtier.core.errors import KvtierError, NotDurable, StaleHandle
from kvtier.wire import errors as E
from kvtier.wire import framing as F
from kvtier.wire import messages as P
from kvtier.wire.dial import dial
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
        E.DaemonTimeout,
        E.BadRange,
        E.NoPools,
        StaleHandle,
        NotDurable,
    )
}


def _raise(err: P.Error) -> None:
    cls = _ERRORS.get(err.code)
    raise cls(err.message) if cls is not None else E.RemoteError(err.code, err.message)


def _readable(sock: socket.socket) -> bool:
    # poll, not select: select(2) takes descriptors below FD_SETSIZE (1024) only, and an engine process holding
    # many files (models, shards, sockets) gets a socket above that ("filedescriptor out of range in select()")
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def default_socket() -> Path:
    """`$KVTIER_SOCKET`, else the socket of the config `kvtier serve` would run on here."""
    if env := os.environ.get("KVTIER_SOCKET"):
        return Path(env)
    from kvtier.core.config import load_config

    return load_config(None).server.socket


class Connection:
    """One socket to the daemon, greeted with hello; one request at a time (a lock serialises threads).

    Every request carries a fresh id that its reply must echo. A call that times out, or whose reply is cut
    off or belongs to another request, closes the socket: a late reply can never answer a later call. The
    next call reconnects (a new hello; subclasses restore their state in `_reopened`), and `epoch` changes at
    every open and close, so state tied to an earlier connection (leases, an offload) is recognised as gone.
    """

    def __init__(
        self, socket_path: str | Path | None = None, *, timeout_s: float | None = 60.0, name: str = ""
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else default_socket()
        self.timeout_s = timeout_s
        self.name = name or f"pid {os.getpid()}"
        self.epoch = 0
        self.daemon = ""
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._closed = False  # close() was called: no reconnecting after that
        self._open()

    def _open(self, timeout_s: float | None = None) -> None:
        """Connect and say hello (caller holds the lock, or is the constructor)."""
        self._sock = dial(self.socket_path, self.timeout_s if timeout_s is None else timeout_s)
        self.epoch += 1
        hello = self._exchange(P.Hello(list(F.SUPPORTED_VERSIONS), self.name), timeout_s=timeout_s)
        assert isinstance(hello, P.HelloOk)
        self.daemon = hello.daemon

    def _reopened(self, timeout_s: float | None) -> None:
        """A fresh connection replaced one closed after a failed call: restore per-connection state (hook)."""

    def _ensure(self, timeout_s: float | None = None) -> None:
        """Reconnect now if the last call closed the connection, or the daemon closed it meanwhile (idle)."""
        if self._sock is not None and _readable(self._sock):
            # between calls nothing is owed to us: readable means EOF or a parting error frame (idle timeout)
            self._drop()
        if self._sock is None:
            self._open(timeout_s)
            self._reopened(timeout_s)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.epoch += 1  # what was tied to the closed connection is stale from now on

    def connected(self, timeout_s: float | None = None) -> int:
        """Reconnect if needed; the epoch of the open connection (pass it to `_call` to stay on it)."""
        with self._lock:
            self._ensure(timeout_s)
            return self.epoch

    def _call(
        self,
        req: P.Msg,
        fds: list[int] | None = None,
        *,
        send_fds: list[int] | None = None,
        timeout_s: float | None = None,
        epoch: int | None = None,
    ) -> Any:
        """Send `req` (with `send_fds` as SCM_RIGHTS) and return its reply; descriptors riding back go to `fds`.

        `timeout_s` overrides the connection's timeout for this call. With `epoch`, the request names state of
        that connection (a lookup, an offload, bytes in its staging region): it is sent only on that very
        connection, never on one reopened since (DaemonUnavailable instead).
        """
        with self._lock:
            if self._closed:
                raise E.OutOfOrder(f"this connection to {self.socket_path} is closed; open a new one")
            if epoch is not None and epoch != self.epoch:
                raise E.DaemonUnavailable(
                    f"the connection to {self.socket_path} this request belongs to was closed after a failed call;"
                    " retry the operation"
                )
            self._ensure(timeout_s)
            return self._exchange(req, fds, send_fds, timeout_s)

    def _exchange(
        self,
        req: P.Msg,
        fds: list[int] | None = None,
        send_fds: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One request and the reply with its id, on the open socket; any failure closes the socket."""
        sock = self._sock
        if sock is None:
            raise E.DaemonUnavailable(f"not connected to {self.socket_path}")
        req.id = rid = next(self._ids)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        op = type(req).__struct_config__.tag
        try:
            try:
                F.send_frame(sock, req, send_fds, deadline)
            except (BrokenPipeError, ConnectionResetError):
                # A daemon that refuses us (permissions, busy) answers and closes before reading:
                # its error frame may already wait in our receive buffer.
                pass
            reply = F.recv_reply(sock, fds=fds, deadline=deadline)
        except TimeoutError:
            self._drop()
            raise E.DaemonTimeout(
                f"the kvtier daemon on {self.socket_path} did not answer {op} within {timeout}s;"
                " closed the connection (the next call reconnects)"
            ) from None
        except (OSError, E.DaemonUnavailable, E.ProtocolError) as exc:
            self._drop()
            raise E.DaemonUnavailable(f"lost the kvtier daemon on {self.socket_path}: {exc}") from None
        if reply.id != rid and not (isinstance(reply, P.Error) and reply.id == 0):
            self._drop()
            raise E.DaemonUnavailable(
                f"the daemon on {self.socket_path} answered request {reply.id} while {op} {rid} waited;"
                " closed the connection (the next call reconnects)"
            )
        if isinstance(reply, P.Error):
            if reply.id == 0:  # a connection-level refusal or framing error: the daemon closes after it
                self._drop()
            _raise(reply)
        return reply

    def stats(self) -> StatsDoc:
        reply: P.StatsOk = self._call(P.Stats())
        return reply.stats

    def namespaces(self, req: P.Namespaces | P.NamespaceRetire | P.NamespacePromote | None = None) -> P.NamespacesOk:
        """The store's namespaces with their state and bytes, after retiring one or promoting a canary (`req`)."""
        return self._call(req if req is not None else P.Namespaces())

    def close(self) -> None:
        """Disconnect for good (a later call is OutOfOrder); the daemon releases everything this connection held."""
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OperatorConnection(Connection):
    """What operator tools (`kvtier prewarm`, `kvtier explain`) speak: attach without mapping the pools, then send
    block hashes. It needs no torch, so these commands start in a fraction of a second."""

    def attach_unmapped(self, profile: str) -> P.AttachOk:
        """Attach this connection to `profile`; the pool descriptors that come with the reply are closed at once."""
        fds: list[int] = []
        try:
            return self._call(P.Attach(profile), fds)
        finally:
            for fd in fds:
                os.close(fd)

    def prewarm_hashes(self, hashes: bytes, ttl_s: float) -> P.PrewarmOk:
        return self._call(P.Prewarm(hashes, ttl_s))

    def explain_hashes(self, hashes: bytes) -> P.ExplainOk:
        return self._call(P.Explain(hashes))

    def engine_namespaces(self) -> P.EngineNamespacesOk:
        """The engine namespaces the daemon's store holds (no attach needed)."""
        return self._call(P.EngineNamespaces())

    def engine_keys(self, req: P.EngineKeys) -> P.EngineKeysOk:
        """Per object of an engine namespace: stored or why not; with `req.prewarm`, loaded, pinned and warmed."""
        return self._call(req)
