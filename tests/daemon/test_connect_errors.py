"""Connect errors say what happened: no daemon, busy (a full listen backlog), or permission denied naming the group;
`kvtier status` exits 3 only when no daemon is there; a connection works on any descriptor number."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier.wire import Connection, DaemonBusy, DaemonUnavailable
from support.daemon import DaemonProc, child_env


def _status(sock: Path, *, as_uid: int | None = None) -> subprocess.CompletedProcess[str]:
    code = "import os, sys\nfrom kvtier.cli.main import main\n"  # imported before dropping privileges
    if as_uid is not None:
        code += f"os.setgid({as_uid}); os.setuid({as_uid})\n"
    code += f"sys.argv = ['kvtier', 'status', '--socket', {str(sock)!r}]\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60, cwd="/"
    )


def test_no_daemon(tmp_path: Path) -> None:
    missing = tmp_path / "none.sock"
    with pytest.raises(DaemonUnavailable, match="no kvtier daemon"):
        Connection(missing, timeout_s=1)
    stale = tmp_path / "stale.sock"  # a socket file nobody listens on: ECONNREFUSED
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    with pytest.raises(DaemonUnavailable, match="no kvtier daemon"):
        Connection(stale, timeout_s=1)
    out = _status(missing)
    assert out.returncode == 3, out.stderr
    assert "no kvtier daemon" in out.stderr and "Traceback" not in out.stderr


def test_full_backlog_is_busy_not_absent(tmp_path: Path) -> None:
    """A listener that never accepts fills its backlog: connects get EAGAIN, retried until the timeout, then busy."""
    path = tmp_path / "busy.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    held = []
    try:
        for _ in range(8):  # fill the backlog (its exact depth is the kernel's business)
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(str(path))
            except BlockingIOError:
                c.close()
                break
            held.append(c)
        else:
            pytest.fail("the backlog never filled")
        with pytest.raises(DaemonBusy, match="busy"):
            Connection(path, timeout_s=0.5)
        out = _status(path)
        assert out.returncode == 4, out.stderr
        assert "busy" in out.stderr
    finally:
        for c in held:
            c.close()
        listener.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_permission_denied_names_the_group() -> None:
    """The socket's mode refuses uid 54321 (EACCES): permission denied, naming the group to join; status exits 4."""
    public = Path(tempfile.mkdtemp(prefix="kvtier-perm-"))
    public.chmod(0o755)
    path = public / "kvtier.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    path.chmod(0o660)
    try:
        out = _status(path, as_uid=54321)
        assert out.returncode == 4, out.stderr
        assert "permission denied" in out.stderr and "join group 'root'" in out.stderr, out.stderr
    finally:
        listener.close()
        path.unlink()
        public.rmdir()


def test_a_connection_on_a_descriptor_above_fd_setsize(shared_daemon: DaemonProc) -> None:
    """An engine holding many files gets its socket above 1024 (FD_SETSIZE), which select(2) cannot take: the
    check between calls for a daemon that closed the connection meanwhile must still work there."""
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with Connection(shared_daemon.socket, timeout_s=30) as c:
            assert c._sock is not None and c._sock.fileno() >= 1024
            epoch = c.epoch
            assert c.stats().profiles == c.stats().profiles  # the second call ran the between-calls check there
            assert c.epoch == epoch  # on the same connection: nothing was dropped and reopened
    finally:
        for fd in fillers:
            os.close(fd)
