"""Bad frames against a real daemon: each gets an error frame or a closed connection, and the daemon keeps serving."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import wire as P
from kvtier.client import Client
from kvtier.wire.errors import DaemonUnavailable, OutOfOrder
from support.daemon import DaemonProc, child_env


def _conn(d: DaemonProc) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(d.socket))
    return s


def _frame(
    body: bytes, *, magic: bytes = P.MAGIC, version: int = P.PROTOCOL_VERSION, length: int | None = None
) -> bytes:
    return P.HEADER.pack(magic, version, 0, len(body) if length is None else length) + body


def _reply_or_close(s: socket.socket) -> P.Reply | None:
    """The daemon's answer: a reply frame, or None if it closed the connection without one."""
    try:
        return P.recv_reply(s)
    except (DaemonUnavailable, ConnectionResetError):
        return None


def _closed(s: socket.socket) -> bool:
    """The daemon hung up (a reset, when it closed with our unread bytes in its buffer)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _still_serving(d: DaemonProc) -> None:
    with Client(d.socket, timeout_s=10) as c:
        assert c.stats().daemon.health == "ok"


def _error(s: socket.socket, body: bytes) -> P.Error:
    s.sendall(_frame(body))
    reply = P.recv_reply(s)
    assert isinstance(reply, P.Error), reply
    return reply


def test_error_codes_and_the_connection_survives(shared_daemon: DaemonProc) -> None:
    s = _conn(shared_daemon)
    enc = msgspec.msgpack.encode
    assert _error(s, b"\xc1\xc1").code == "bad_frame"  # undecodable msgpack
    assert _error(s, enc([1, 2, 3])).code == "wrong_type"  # not a map
    assert _error(s, enc({"hashes": b""})).code == "wrong_type"  # no op
    assert _error(s, enc({"op": "frobnicate"})).code == "unknown_op"
    assert _error(s, enc({"op": "lookup", "hashes": 5})).code == "wrong_type"
    assert _error(s, enc({"op": "attach"})).code == "wrong_type"  # missing field
    assert _error(s, enc({"op": "stats", "extra": 1})).code == "wrong_type"  # unknown field
    assert _error(s, enc({"op": "lookup", "hashes": b"\0" * 16})).code == "out_of_order"  # before attach
    assert _error(s, enc({"op": "load", "lookup_id": 1})).code == "out_of_order"
    assert _error(s, enc({"op": "hello", "versions": [1]})).code == "out_of_order"  # not first
    assert _error(s, enc({"op": "attach", "profile": "no-such-profile"})).code != "internal"
    # the same connection still works after all of that
    s.sendall(_frame(enc({"op": "stats"})))
    assert isinstance(P.recv_reply(s), P.StatsOk)
    s.close()


def test_version_negotiation(shared_daemon: DaemonProc) -> None:
    s = _conn(shared_daemon)
    assert _error(s, msgspec.msgpack.encode({"op": "hello", "versions": [99]})).code == "unsupported_version"
    s.close()
    s = _conn(shared_daemon)
    s.sendall(_frame(msgspec.msgpack.encode({"op": "stats"}), version=99))
    reply = _reply_or_close(s)
    assert reply is None or (isinstance(reply, P.Error) and reply.code == "unsupported_version")
    assert _closed(s)  # and then closed: the stream cannot be trusted
    _still_serving(shared_daemon)


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\n\r\n",  # wrong magic
        P.HEADER.pack(P.MAGIC, 1, 0, 2**32 - 1),  # huge length prefix
        P.HEADER.pack(P.MAGIC, 1, 0, 64 * 2**20),  # over max_frame_bytes
    ],
    ids=["bad-magic", "huge-length", "over-limit"],
)
def test_unframeable_input_gets_error_then_close(shared_daemon: DaemonProc, raw: bytes) -> None:
    s = _conn(shared_daemon)
    s.sendall(raw)
    reply = _reply_or_close(s)
    assert isinstance(reply, P.Error) and reply.code in ("bad_frame", "frame_too_large")
    assert _closed(s)
    s.close()
    _still_serving(shared_daemon)


@pytest.mark.parametrize("cut", [3, P.HEADER.size, P.HEADER.size + 4])
def test_truncated_frame_then_hangup(shared_daemon: DaemonProc, cut: int) -> None:
    s = _conn(shared_daemon)
    s.sendall(_frame(msgspec.msgpack.encode({"op": "attach", "profile": "ref-tiny"}))[:cut])
    s.close()
    _still_serving(shared_daemon)


def test_stalled_clients_hold_nothing(shared_daemon: DaemonProc) -> None:
    """An idle connection and one stuck mid-frame do not delay others; the mid-frame one is cut at frame_timeout_s."""
    idle = _conn(shared_daemon)
    stuck = _conn(shared_daemon)
    stuck.sendall(_frame(msgspec.msgpack.encode({"op": "stats"}))[:5])
    _still_serving(shared_daemon)  # answered while both stall
    reply = _reply_or_close(stuck)  # frame_timeout_s = 1 in the test config
    assert reply is None or (isinstance(reply, P.Error) and reply.code == "bad_frame")
    assert _closed(stuck)
    idle.sendall(_frame(msgspec.msgpack.encode({"op": "stats"})))  # idle between frames is fine
    assert isinstance(P.recv_reply(idle), P.StatsOk)
    idle.close()
    stuck.close()


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_ops = st.sampled_from([*sorted(P.REQUEST_OPS), "", "Lookup", "attach\0", "stats_ok", "error"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    op=_ops,
    fields=st.dictionaries(
        st.sampled_from(
            [
                "profile",
                "hashes",
                "lookup_id",
                "handle",
                "versions",
                "ttl_s",
                "durable",
                "groups",
                "blocks",
                "offload_id",
                "timeout_s",
                "version_key",
                "staging_bytes",
                "items",
                "x",
            ]
        ),
        _values,
        max_size=4,
    ),
)
def test_fuzzed_requests_get_an_answer(shared_daemon: DaemonProc, op: str, fields: dict) -> None:
    s = _conn(shared_daemon)
    try:
        s.sendall(_frame(msgspec.msgpack.encode({"op": op, **fields})))
        reply = P.recv_reply(s)
        assert not (isinstance(reply, P.Error) and reply.code == "internal"), reply
        s.sendall(_frame(msgspec.msgpack.encode({"op": "stats"})))
        assert isinstance(P.recv_reply(s), P.StatsOk)
    finally:
        s.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(min_size=1, max_size=300))
def test_random_bytes(shared_daemon: DaemonProc, raw: bytes) -> None:
    s = _conn(shared_daemon)
    try:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):  # error frames, then the close
            pass
    except ConnectionResetError:
        pass
    finally:
        s.close()


def test_still_serving_after_the_fuzz(shared_daemon: DaemonProc) -> None:
    _still_serving(shared_daemon)
    assert shared_daemon.proc.poll() is None
    assert "Traceback" not in shared_daemon.read_log()


def test_socket_mode(shared_daemon: DaemonProc) -> None:
    # user mode (the default for whoever runs it, root too): 0660; system mode's socket is 0666, the daemon
    # admitting each peer by SO_PEERCRED. The module's daemon has the default config: no daemon of its own.
    assert os.stat(shared_daemon.socket).st_mode & 0o777 == 0o660


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_peer_credentials(tmp_path: Path) -> None:
    """SO_PEERCRED: a uid outside allowed_uids / allowed_gids is refused even where the file mode lets it connect,
    and a uid in the list is admitted. One daemon allows uid 54321: 54321 asks (admitted), then 54322 (refused)."""
    public = Path(tempfile.mkdtemp(prefix="kvtier-peer-"))
    public.chmod(0o755)
    d = DaemonProc(
        tmp_path, socket_path=public / "kvtier.sock", server_toml='socket_mode = "0666"\nallowed_uids = [54321]\n'
    )

    def stats_as(uid: int) -> str:
        code = (
            "import os\n"
            "from kvtier.client import Client\n"  # imported first: the stdlib may be unreadable to that uid
            f"os.setgid({uid}); os.setuid({uid})\n"
            "try:\n"
            f"    Client({str(d.socket)!r}).stats(); print('ok')\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, getattr(e, 'code', ''))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60, cwd="/"
        )
        return out.stdout.strip() or out.stderr

    try:
        assert stats_as(54321) == "ok"
        assert stats_as(54322) == "PermissionDenied permission_denied"
    finally:
        assert d.terminate() == 0
        shutil.rmtree(public, ignore_errors=True)


def test_typed_errors_reach_the_client(shared_daemon: DaemonProc) -> None:
    with Client(shared_daemon.socket) as c, pytest.raises(OutOfOrder):
        c._call(P.Lookup(b"\0" * 16))
