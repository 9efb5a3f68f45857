"""Typed errors of the wire protocol and of talking to the daemon; each `code` travels in error frames."""

from __future__ import annotations

from kvtier.core.errors import KvtierError


class ProtocolError(KvtierError):
    """A request frame is malformed; the daemon answers with an error frame and keeps serving."""

    code = "bad_frame"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class UnknownOp(ProtocolError):
    code = "unknown_op"


class WrongType(ProtocolError):
    code = "wrong_type"


class UnsupportedVersion(ProtocolError):
    code = "unsupported_version"


class BadRange(ProtocolError):
    """A raw tier item names bytes outside the connection's staging region."""

    code = "bad_range"


class OutOfOrder(ProtocolError):
    """A request that needs an earlier step (hello, attach, a lookup) that this connection has not made."""

    code = "out_of_order"


class NoPools(KvtierError):
    """An attach this daemon cannot serve with pools: it has none (an engine-only node), or they are still being
    allocated, or their allocation failed; the message says which and what to do."""

    code = "no_pools"


class PermissionDenied(KvtierError):
    """The socket's file mode refused us (EACCES), or the peer's uid / gid is not among the daemon's allowed ones;
    the message names the group to join."""

    code = "permission_denied"


class DaemonUnavailable(KvtierError):
    """No daemon on the socket (ENOENT / ECONNREFUSED), or it went away mid-request."""

    code = "daemon_unavailable"


class DaemonTimeout(DaemonUnavailable):
    """The daemon did not answer within the call's deadline; the connection was closed (the next call reconnects)."""

    code = "daemon_timeout"


class DaemonBusy(KvtierError):
    """The daemon refuses new work: its listen backlog stayed full for the client's timeout, it is at its
    connection or receive-buffer cap, or it is shutting down. Retrying later is the remedy."""

    code = "busy"


class RemoteError(KvtierError):
    """An error frame from the daemon whose code the client has no class for; keeps the daemon's code."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)
