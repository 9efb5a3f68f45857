"""The unix-socket server: a thread per speaking connection, peer credentials, request order, error frames.

A connection never blocks another: until it sends its first bytes the main loop watches it
(`kvtier.daemon.silent_connections`), then a thread serves it alone while it lasts (`kvtier.daemon.workers`: threads
are kept for later connections, not started per connection), the backend is thread-safe, and no lock is held while
waiting on a socket (the main loop only peeks). What a client can hold is bounded: its first frame must come within
`hello_timeout_s`, it may idle `idle_timeout_s` between frames, a begun frame must arrive whole (and its reply be
taken) within `frame_timeout_s`, and the receive buffer grows with the bytes that arrived (never the length a header
announces) under `max_frame_bytes` per frame and `max_buffered_bytes` over all connections. At `max_connections` the
oldest connection that has sent nothing yet (no byte waiting) makes room, else the new one is answered `busy`. Each
connection is an *owner*: when it goes away, for any reason, `backend.release_owner(owner)` drops every lease it
held. Every reply carries its request's id."""

from __future__ import annotations

import ctypes
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
from typing import Any

from kvtier import __version__
from kvtier.core.config import ServerConfig
from kvtier.core.errors import KvtierError
from kvtier.daemon.session import Backend, Peer, Session
from kvtier.daemon.silent_connections import Lobby, Waiting
from kvtier.daemon.workers import Workers
from kvtier.wire import framing as F
from kvtier.wire import messages as P
from kvtier.wire.dial import group_names
from kvtier.wire.errors import DaemonBusy, OutOfOrder, PermissionDenied, ProtocolError, UnsupportedVersion
from kvtier.wire.stats import StatsDoc

log = logging.getLogger(__name__)
_PEERCRED = struct.Struct("3i")
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
ACCEPT_BATCH = 64  # connections accepted per turn of the main loop
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


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
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)  # the main loop accepts until the backlog is empty
    return sock


def _return_big_buffers_to_the_os() -> None:
    """Frame buffers of many MiB come and go on many threads; glibc's adaptive mmap threshold would soon serve
    them from per-thread heaps that keep the memory after a frame is done. A fixed 1 MiB threshold maps each
    one and unmaps it when freed, so RSS follows the frames in flight (bounded by max_buffered_bytes)."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        pass


class _Quiet(Exception):
    """A connection closed for saying nothing (no first frame in time, or idle too long): no answer owed."""


class SocketServer:
    """Accepts connections and serves each on a worker thread once it has spoken. The caller's loop calls
    `accept_ready` when the listener is readable, `greet_ready` when `lobby` is (connections that sent their
    first bytes), and `expire_silent` at least every `lobby.due()` seconds."""

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
        self.lobby = Lobby(cfg.hello_timeout_s)  # accepted connections that have sent nothing yet
        self._workers = Workers(self._serve, "kvtier-conn")
        self.budget = F.ByteBudget(cfg.max_buffered_bytes)
        _return_big_buffers_to_the_os()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._closing = False
        self._dispatch: dict[type, Callable[[Session, Any], P.Msg]] = {
            P.Lookup: backend.lookup,
            P.Release: backend.release,
            P.Load: backend.load,
            P.Offload: backend.offload,
            P.Renew: backend.renew,
            P.Prewarm: backend.prewarm,
            P.Explain: backend.explain,
        }
        self._tier_dispatch: dict[type, Callable[[Session, Any], P.Msg]] = {
            P.TierHas: backend.tier.has,
            P.TierKeys: backend.tier.keys,
            P.TierStore: backend.tier.store_many,
            P.TierLoad: backend.tier.load,
        }

    # -- accepting -------------------------------------------------------------------------------

    def accept_ready(self) -> None:
        """Accept up to ACCEPT_BATCH connections waiting in the backlog (the listener is non-blocking): then the
        loop greets those that have spoken, which a backlog kept full would otherwise hold off for good."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if not self._closing:
                    log.warning("accept failed: %s", exc)
                return
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        peer = peer_credentials(conn)
        refusal: KvtierError | None = None
        victim: Waiting | None = None
        if not peer_allowed(peer, self.cfg):
            refusal = PermissionDenied(
                f"uid {peer.uid} / gid {peer.gid} may not use this daemon; {self._how_to_join()}"
            )
        with self._lock:
            if refusal is None and self._closing:
                refusal = DaemonBusy("the daemon is shutting down; retry later")
            elif refusal is None and len(self._conns) >= self.cfg.max_connections:
                victim = self.lobby.victim()
                if victim is None:
                    refusal = DaemonBusy(
                        f"the daemon is at server.max_connections ({self.cfg.max_connections}); retry later"
                    )
            if refusal is None:
                owner = next(self._owners)
                self._conns[owner] = conn
        if victim is not None:
            self._end_silent(victim, "nothing sent yet, and the daemon is at max_connections")
        if refusal is not None:
            log.warning("refused pid %d uid %d: %s", peer.pid, peer.uid, refusal)
            self._refuse(conn, refusal)
            return
        self.lobby.enter(owner, conn, Session(owner, peer), time.monotonic())

    def greet_ready(self) -> None:
        """Hand each connection that has spoken to a worker; close those whose peer left without a word."""
        spoken, gone = self.lobby.ready()
        for w in spoken:
            self._workers.submit(w.conn, w.session)
        for w in gone:
            self._end_silent(w, None)

    def expire_silent(self, now: float) -> None:
        """Close the connections that sent nothing within hello_timeout_s."""
        for w in self.lobby.expired(now):
            self._end_silent(w, f"no first frame for {self.cfg.hello_timeout_s}s")

    def _end_silent(self, w: Waiting, why: str | None) -> None:
        """Close a connection out of the lobby (`why` None: its peer left). It never sent a frame, so it holds no
        lease to release."""
        if why is not None:
            log.info("connection %d (pid %d): %s; closing", w.owner, w.session.peer.pid, why)
        w.conn.close()
        with self._lock:
            self._conns.pop(w.owner, None)
            self._idle.notify_all()

    def _how_to_join(self) -> str:
        if self.cfg.allowed_gids:
            return f"join one of the groups {', '.join(group_names(self.cfg.allowed_gids))} (then log in again)"
        return "add the uid to server.allowed_uids, or a group of it to server.allowed_gids"

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
                body: bytearray | None = None
                try:
                    body = self._read_frame(conn, received, first=session.requests == 0)
                    if body is None:
                        return
                    with self._lock:
                        self._inflight += 1
                    try:
                        reply, fds = self._handle(session, body, received)
                        F.send_frame(conn, reply, fds, time.monotonic() + self.cfg.frame_timeout_s)
                    finally:
                        with self._lock:
                            self._inflight -= 1
                            self._idle.notify_all()
                finally:
                    if body:
                        self.budget.give(len(body))
                    for fd in received:  # a handler maps what it keeps: no descriptor a client sends outlives it
                        os.close(fd)
        except (ProtocolError, DaemonBusy) as exc:
            log.info("connection %d (pid %d): %s; closing", session.owner, session.peer.pid, exc)
            try:
                F.send_frame(conn, P.Error(exc.code, str(exc)), None, time.monotonic() + 1.0)
            except OSError:
                pass
        except _Quiet as exc:
            log.info("connection %d (pid %d): %s; closing", session.owner, session.peer.pid, exc)
        except (OSError, KvtierError) as exc:
            log.info("connection %d (pid %d) dropped: %s", session.owner, session.peer.pid, exc)
        finally:
            conn.close()
            released = self.backend.release_owner(session.owner)
            if released:
                log.info("connection %d (pid %d) gone: released %d leases", session.owner, session.peer.pid, released)
            with self._lock:
                self._conns.pop(session.owner, None)
                self._idle.notify_all()

    def _read_frame(self, conn: socket.socket, fds: list[int], *, first: bool) -> bytearray | None:
        """The next request body; None when the peer closed between frames. Framing errors raise (and close).

        SCM_RIGHTS descriptors riding along with the frame are appended to `fds` (the caller closes them);
        the body's bytes are reserved from `self.budget` (the caller gives them back).
        """
        cfg = self.cfg
        wait = cfg.hello_timeout_s if first else (cfg.idle_timeout_s or None)
        conn.settimeout(wait)
        try:
            start = F.recv_exact(conn, 1, fds)
        except TimeoutError:
            raise _Quiet(f"{'no first frame' if first else 'idle'} for {wait}s") from None
        if not start:
            return None
        deadline = time.monotonic() + cfg.frame_timeout_s
        try:
            header = start + F.recv_exact(conn, F.HEADER.size - 1, fds, deadline=deadline)
            if len(header) < F.HEADER.size:
                raise ProtocolError("truncated frame header")
            length = F.parse_header(header, cfg.max_frame_bytes)
            body = F.recv_exact(conn, length, fds, deadline=deadline, budget=self.budget)
        except TimeoutError:
            raise ProtocolError(f"frame not completed within {cfg.frame_timeout_s}s") from None
        if len(body) < length:
            self.budget.give(len(body))
            raise ProtocolError("truncated frame body")
        return body

    def _handle(self, session: Session, body: bytearray, received: list[int]) -> tuple[P.Msg, list[int]]:
        """One request to its reply; every KvtierError (including bad requests) becomes an error frame."""
        started = time.perf_counter()
        op = "?"
        rid = 0
        session.requests += 1
        try:
            try:
                req = P.decode_request(body)
            except ProtocolError as exc:
                log.info("connection %d (pid %d): %s", session.owner, session.peer.pid, exc)
                raise
            op, rid = str(type(req).__struct_config__.tag), req.id
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
        reply.id = rid
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
            session.attached, session.namespace = reply.profile, reply.namespace
            return reply, fds
        if isinstance(req, P.Stats):
            return P.StatsOk(self.stats_doc()), []
        if isinstance(req, P.Flush):
            return self.backend.flush(session, req), []
        if isinstance(req, (P.Namespaces, P.NamespaceRetire, P.NamespacePromote)):
            return self.backend.namespaces(session, req), []
        if isinstance(req, (P.EngineNamespaces, P.EngineKeys)):
            return self.backend.engine_op(session, req), []
        if isinstance(req, P.TierOpen):
            if session.tier_open:
                raise OutOfOrder(
                    "tier_open was already sent on this connection; open another connection for another namespace"
                )
            opened = self.backend.tier.open(session, req, received)
            session.tier_open = True
            return opened, []
        if type(req) in self._tier_dispatch:
            if not session.tier_open:
                op = type(req).__struct_config__.tag
                raise OutOfOrder(f"{op} before tier_open: open the namespace and staging region first")
            return self._tier_dispatch[type(req)](session, req), []
        if session.attached is None:
            op = type(req).__struct_config__.tag
            raise OutOfOrder(f"{op} before attach: attach to a profile first")
        stale = self.backend.stale_reply(session, req)  # attached to a namespace retired since (a rollout)
        if stale is not None:
            return stale, []
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
        """Let in-flight requests finish, end idle connections, wait until every connection is served to its end;
        True if all ended."""
        for w in self.lobby.empty():  # no thread serves these: they end here
            self._end_silent(w, None)
        self.lobby.close()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RD)  # a thread waiting for its next request sees EOF; one mid-request ends
            except OSError:
                pass
        while True:
            with self._lock:
                if not self._conns:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("%d connections still busy at the shutdown deadline", len(self._conns))
                    return False
                self._idle.wait(min(remaining, 0.5))
            tick()
