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


class PermissionDenied(KvtierError):
    """The peer's uid / gid is not among the daemon's allowed ones."""

    code = "permission_denied"


class DaemonUnavailable(KvtierError):
    """No daemon answers on the socket, or it went away mid-request."""

    code = "daemon_unavailable"
    exit_code = 3  # what every CLI command exits with when no daemon answers


class DaemonBusy(KvtierError):
    """The daemon refuses new work: it is at its connection cap or shutting down."""

    code = "busy"


class RemoteError(KvtierError):
    """An error frame from the daemon whose code the client has no class for; keeps the daemon's code."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)
