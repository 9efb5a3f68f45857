"""The unix-socket server: one thread per connection, peer credentials, request order, error frames.

A connection never blocks another: each has its own thread, the backend is thread-safe, and no lock
is held while waiting on a socket. A connection idles freely between requests, but once a frame has
begun it must arrive (and its reply be taken) within `frame_timeout_s`, or it is closed. Each
connection is an *owner*: when it goes away, for any reason, `backend.release_owner(owner)` drops
every lease it held.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier import __version__
from kvtier.core.config import ServerConfig
from kvtier.core.errors import KvtierError
from kvtier.daemon.session import Backend, Peer, Session
from kvtier.wire import framing as F
from kvtier.wire import messages as P
from kvtier.wire.errors import DaemonBusy, OutOfOrder, PermissionDenied, ProtocolError, UnsupportedVersion
from kvtier.wire.stats import StatsDoc

log = logging.getLogger(__name__)
_PEERCRED = struct.Struct("3i")


def peer_credentials(conn: socket.socket) -> Peer:
    pid, uid, gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return Peer(pid, uid, gid)


def _supplementary_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def peer_allowed(peer: Peer, cfg: ServerConfig) -> bool:
    """Root, our own uid, an allowed uid, or an allowed primary or supplementary gid."""
    if peer.uid in (0, os.geteuid()) or peer.uid in cfg.allowed_uids or peer.gid in cfg.allowed_gids:
        return True
    return bool(cfg.allowed_gids) and bool(_supplementary_groups(peer.pid) & set(cfg.allowed_gids))


def claim_socket_path(path: Path) -> None:
    """Make `path` bindable: a stale socket file is removed; a live daemon or a non-socket file is refused."""
    if not (path.exists() or path.is_symlink()):
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise KvtierError(f"{path} exists and is not a socket; remove it or set server.socket elsewhere")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
    else:
        raise KvtierError(f"another daemon is serving on {path}; stop it or set server.socket elsewhere")
    finally:
        probe.close()


def bind_socket(path: Path, mode: int) -> socket.socket:
    """Listen on `path` with `mode` from the first instant."""
    path.parent.mkdir(parents=True, exist_ok=True)
    claim_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(128)
    return sock


class SocketServer:
    """Accepts connections (the caller's loop calls `accept_one` when the listener is readable), each in a thread."""

    def __init__(
        self,
        cfg: ServerConfig,
        backend: Backend,
        stats_doc: Callable[[], StatsDoc],
        *,
        on_request: Callable[[str, float, str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.stats_doc = stats_doc
        self.on_request = on_request
        self.listener = bind_socket(cfg.socket, cfg.socket_mode)
        self._owners = itertools.count(1)
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._closing = False
        self._dispatch: dict[type, Callable[[Session, P.Msg], P.Msg]] = {
            P.Lookup: backend.lookup,
            P.Release: backend.release,
            P.Load: backend.load,
            P.Offload: backend.offload,
            P.Renew: backend.renew,
            P.Prewarm: backend.prewarm,
        }
        self._tier_dispatch: dict[type, Callable[[Session, P.Msg], P.Msg]] = {
            P.TierHas: backend.tier.has,
            P.TierStore: backend.tier.store_many,
            P.TierLoad: backend.tier.load,
        }

    # -- accepting -------------------------------------------------------------------------------

    def fileno(self) -> int:
        return self.listener.fileno()

    def accept_one(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if self._closing:
                return
            log.warning("accept failed: %s", exc)
            return
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        peer = peer_credentials(conn)
        refusal: KvtierError | None = None
        if not peer_allowed(peer, self.cfg):
            refusal = PermissionDenied(
                f"uid {peer.uid} / gid {peer.gid} may not use this daemon;"
                " add it to server.allowed_uids or allowed_gids"
            )
        with self._lock:
            if refusal is None and (self._closing or len(self._conns) >= self.cfg.max_connections):
                refusal = DaemonBusy("the daemon is shutting down or at server.max_connections; retry later")
            if refusal is None:
                owner = next(self._owners)
                self._conns[owner] = conn
                thread = threading.Thread(
                    target=self._serve, args=(conn, Session(owner, peer)), name=f"kvtier-conn-{owner}", daemon=True
                )
                self._threads[owner] = thread
        if refusal is not None:
            log.warning("refused pid %d uid %d: %s", peer.pid, peer.uid, refusal)
            self._refuse(conn, refusal)
            return
        thread.start()

    def _refuse(self, conn: socket.socket, exc: KvtierError) -> None:
        try:
            conn.settimeout(1.0)
            F.send_frame(conn, P.Error(exc.code, str(exc)))
        except OSError:
            pass
        finally:
            conn.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # -- one connection ---------------------------------------------------------------------------

    def _serve(self, conn: socket.socket, session: Session) -> None:
        try:
            while True:
                received: list[int] = []
                try:
                    body = self._read_frame(conn, received)
                    if body is None:
                        return
                    with self._lock:
                        self._inflight += 1
                    try:
                        reply, fds = self._handle(session, body, received)
                        conn.settimeout(self.cfg.frame_timeout_s)
                        F.send_frame(conn, reply, fds)
                    finally:
                        with self._lock:
                            self._inflight -= 1
                            self._idle.notify_all()
                finally:
                    for (
                        fd
                    ) in received:  # a handler maps what it keeps: no descriptor a client sends outlives its request
                        os.close(fd)
        except ProtocolError as exc:
            log.info("connection %d (pid %d): %s; closing", session.owner, session.peer.pid, exc)
            try:
                F.send_frame(conn, P.Error(exc.code, str(exc)))
            except OSError:
                pass
        except (OSError, KvtierError) as exc:
            log.info("connection %d (pid %d) dropped: %s", session.owner, session.peer.pid, exc)
        finally:
            conn.close()
            released = self.backend.release_owner(session.owner)
            if released:
                log.info("connection %d (pid %d) gone: released %d leases", session.owner, session.peer.pid, released)
            with self._lock:
                self._conns.pop(session.owner, None)
                self._threads.pop(session.owner, None)
                self._idle.notify_all()

    def _read_frame(self, conn: socket.socket, fds: list[int]) -> bytes | None:
        """The next request body; None when the peer closed between frames. Framing errors raise (and close).

        SCM_RIGHTS descriptors riding along with the frame are appended to `fds` (the caller closes them).
        """
        conn.settimeout(None)
        first = F.recv_exact(conn, 1, fds)
        if not first:
            return None
        conn.settimeout(self.cfg.frame_timeout_s)
        try:
            header = first + F.recv_exact(conn, F.HEADER.size - 1, fds)
            if len(header) < F.HEADER.size:
                raise ProtocolError("truncated frame header")
            length = F.parse_header(header, self.cfg.max_frame_bytes)
            body = F.recv_exact(conn, length, fds)
        except TimeoutError:
            raise ProtocolError(f"frame not completed within {self.cfg.frame_timeout_s}s") from None
        if len(body) < length:
            raise ProtocolError("truncated frame body")
        return body

    def _handle(self, session: Session, body: bytes, received: list[int]) -> tuple[P.Msg, list[int]]:
        """One request to its reply; every KvtierError (including bad requests) becomes an error frame."""
        started = time.perf_counter()
        op = "?"
        try:
            req = P.decode_request(body)
            op = type(req).__struct_config__.tag  # type: ignore[attr-defined]
            session.requests += 1
            reply, fds = self._route(session, req, received)
        except KvtierError as exc:
            reply, fds = P.Error(exc.code, str(exc)), []
        except Exception as exc:  # a bug must not take the daemon (or other clients) down
            log.exception("internal error serving %s for connection %d", op, session.owner)
            reply, fds = (
                P.Error("internal", f"internal error in the daemon ({type(exc).__name__}: {exc}); see its log"),
                [],
            )
        if self.on_request is not None:
            self.on_request(op, time.perf_counter() - started, reply.code if isinstance(reply, P.Error) else "ok")
        return reply, fds

    def _route(self, session: Session, req: P.Msg, received: list[int]) -> tuple[P.Msg, list[int]]:
        if isinstance(req, P.Hello):
            if session.requests != 1:
                raise OutOfOrder("hello must be the first request on a connection")
            common = set(req.versions) & set(F.SUPPORTED_VERSIONS)
            if not common:
                raise UnsupportedVersion(
                    f"no common protocol version: client {req.versions}, daemon {list(F.SUPPORTED_VERSIONS)}"
                )
            return P.HelloOk(max(common), f"kvtier {__version__}", os.getpid()), []
        if isinstance(req, P.Attach):
            if session.attached is not None:
                raise OutOfOrder(
                    f"this connection is already attached to {session.attached!r};"
                    " open another connection for another profile"
                )
            reply, fds = self.backend.attach(session, req)
            session.attached = reply.profile
            return reply, fds
        if isinstance(req, P.Stats):
            return P.StatsOk(self.stats_doc()), []
        if isinstance(req, P.Flush):
            return self.backend.flush(session, req), []
        if isinstance(req, P.TierOpen):
            if session.tier_open:
                raise OutOfOrder(
                    "tier_open was already sent on this connection; open another connection for another namespace"
                )
            reply = self.backend.tier.open(session, req, received)
            session.tier_open = True
            return reply, []
        if type(req) in self._tier_dispatch:
            if not session.tier_open:
                op = type(req).__struct_config__.tag  # type: ignore[attr-defined]
                raise OutOfOrder(f"{op} before tier_open: open the namespace and staging region first")
            return self._tier_dispatch[type(req)](session, req), []
        if session.attached is None:
            op = type(req).__struct_config__.tag  # type: ignore[attr-defined]
            raise OutOfOrder(f"{op} before attach: attach to a profile first")
        if isinstance(req, P.Seal):  # a cpu offload's staging memfd rides along
            return self.backend.seal(session, req, received), []
        return self._dispatch[type(req)](session, req), []

    # -- shutdown ---------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        with self._lock:
            self._closing = True
        try:
            self.cfg.socket.unlink()
        except FileNotFoundError:
            pass
        self.listener.close()

    def drain(self, deadline: float, tick: Callable[[], None] = lambda: None) -> bool:
        """Let in-flight requests finish, end idle connections, wait for every connection thread; True if all ended."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.shutdown(
                    socket.SHUT_RD
                )  # a thread waiting for its next request sees EOF; one mid-request finishes
            except OSError:
                pass
        while True:
            with self._lock:
                if not self._threads:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("%d connections still busy at the shutdown deadline", len(self._threads))
                    return False
                self._idle.wait(min(remaining, 0.5))
            tick()
