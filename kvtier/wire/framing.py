"""Frames on a unix stream socket: an 8-byte header, then a msgpack body (see `kvtier.wire.messages`).

Frame = `b"KT" | version u8 | flags u8 | length u32 (big endian)` + `length` bytes. File descriptors travel as
SCM_RIGHTS with a frame's first byte.
"""

from __future__ import annotations

import array
import socket
import struct
import threading
import time

from kvtier.wire.errors import DaemonBusy, DaemonUnavailable, FrameTooLarge, ProtocolError, UnsupportedVersion
from kvtier.wire.messages import Msg, Reply, decode_reply, encode_body

MAGIC = b"KT"
PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
HEADER = struct.Struct(">2sBBI")
MAX_FDS = 64


def encode(msg: Msg, version: int = PROTOCOL_VERSION) -> bytes:
    """One whole frame: header + msgpack body."""
    body = encode_body(msg)
    return HEADER.pack(MAGIC, version, 0, len(body)) + body


def parse_header(header: bytes | bytearray, max_frame: int) -> int:
    """Body length of a frame; a bad magic, version or size is a ProtocolError (the stream cannot be resynced)."""
    magic, version, _flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad frame magic {magic!r}: this socket speaks the kvtier protocol (frames start with b'KT')"
        )
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"protocol version {version} not supported (supported: {list(SUPPORTED_VERSIONS)});"
            " upgrade the client or daemon"
        )
    if length > max_frame:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the limit of {max_frame}; split the request")
    return length


# -- socket I/O ----------------------------------------------------------------------------------

CHUNK = 64 * 1024  # a receive buffer grows by what arrived, at most this much per recv


class ByteBudget:
    """Bytes of frames being received at once, across connections: a global cap no set of senders can pass.

    `take` reserves as bytes arrive (never the length a header announces); a reservation over the cap raises
    DaemonBusy, and the connection that asked is closed with a `busy` answer.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            if self.used + n > self.cap:
                raise DaemonBusy(
                    f"the daemon is receiving {self.used} bytes of frames already (cap {self.cap}); retry later"
                )
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


def send_frame(sock: socket.socket, msg: Msg, fds: list[int] | None = None, deadline: float | None = None) -> None:
    """Send one frame (by `deadline`, a time.monotonic() value, if given); fds travel as SCM_RIGHTS with byte 0."""
    data = encode(msg)
    if deadline is not None:
        sock.settimeout(_remaining(deadline))
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
        data = data[sent:]
    if data:
        sock.sendall(data)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def recv_exact(
    sock: socket.socket,
    n: int,
    fds: list[int] | None = None,
    *,
    deadline: float | None = None,
    budget: ByteBudget | None = None,
) -> bytearray:
    """Exactly n bytes (the receive buffer itself, no second copy); empty if the peer closed before the first
    byte; DaemonUnavailable if it closed mid-way.

    The buffer grows with what arrives (a peer announcing 2 GiB and sending a byte holds a byte); with a
    `deadline` the whole read must finish by it (TimeoutError), however slowly the peer trickles; with a
    `budget`, arrived bytes are reserved from it (given back here on failure, by the caller after use).
    SCM_RIGHTS descriptors riding along are appended to `fds` when given.
    """
    buf = bytearray()
    scratch = bytearray(min(n, CHUNK))
    view = memoryview(scratch)
    anc = socket.CMSG_SPACE(MAX_FDS * 4)
    try:
        while len(buf) < n:
            if deadline is not None:
                sock.settimeout(_remaining(deadline))
            want = min(n - len(buf), len(scratch))
            if fds is None:
                k = sock.recv_into(view[:want])
            else:
                k, ancdata, _flags, _addr = sock.recvmsg_into([view[:want]], anc)
                for level, kind, data in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
            if k == 0:
                if not buf:
                    return buf
                raise DaemonUnavailable(f"peer closed the connection mid-frame ({len(buf)} of {n} bytes)")
            if budget is not None:
                budget.take(k)
            buf += view[:k]
    except BaseException:
        if budget is not None:
            budget.give(len(buf))
        raise
    return buf


def recv_reply(
    sock: socket.socket, max_frame: int = 1 << 31, fds: list[int] | None = None, deadline: float | None = None
) -> Reply:
    """One reply frame (the client's side), whole by `deadline` if given (TimeoutError otherwise)."""
    header = recv_exact(sock, HEADER.size, fds, deadline=deadline)
    if not header:
        raise DaemonUnavailable("the daemon closed the connection")
    return decode_reply(recv_exact(sock, parse_header(header, max_frame), fds, deadline=deadline) or b"")
