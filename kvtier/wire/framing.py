"""Frames on a unix stream socket: an 8-byte header, then a msgpack body (see `kvtier.wire.messages`).

Frame = `b"KT" | version u8 | flags u8 | length u32 (big endian)` + `length` bytes. File descriptors travel as
SCM_RIGHTS with a frame's first byte.
"""

from __future__ import annotations

import array
import socket
import struct

from kvtier.wire.errors import DaemonUnavailable, FrameTooLarge, ProtocolError, UnsupportedVersion
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


def parse_header(header: bytes, max_frame: int) -> int:
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


def send_frame(sock: socket.socket, msg: Msg, fds: list[int] | None = None) -> None:
    """Send one frame; file descriptors travel as SCM_RIGHTS with its first byte."""
    data = encode(msg)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_exact(sock: socket.socket, n: int, fds: list[int] | None = None) -> bytes:
    """Exactly n bytes; b'' if the peer closed before the first byte; DaemonUnavailable if it closed mid-way.

    With `fds` given, SCM_RIGHTS descriptors riding along are appended to it.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    anc = socket.CMSG_SPACE(MAX_FDS * 4)
    while got < n:
        if fds is None:
            k = sock.recv_into(view[got:])
        else:
            k, ancdata, _flags, _addr = sock.recvmsg_into([view[got:]], anc)
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if k == 0:
            if got == 0:
                return b""
            raise DaemonUnavailable(f"peer closed the connection mid-frame ({got} of {n} bytes)")
        got += k
    return bytes(buf)


def recv_reply(sock: socket.socket, max_frame: int = 1 << 31, fds: list[int] | None = None) -> Reply:
    """One reply frame (the client's side)."""
    header = recv_exact(sock, HEADER.size, fds)
    if not header:
        raise DaemonUnavailable("the daemon closed the connection")
    return decode_reply(recv_exact(sock, parse_header(header, max_frame), fds) or b"")
