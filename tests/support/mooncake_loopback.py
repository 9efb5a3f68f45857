"""Mooncake on loopback for tests and benches: a master (or two HA masters over etcd) and holder processes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from support.procs import all_threads_stopped

REPO = pathlib.Path(__file__).resolve().parents[2]
LOOPBACK_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def unavailable() -> str | None:
    """Why Mooncake cannot run here (one line), or None."""
    try:
        from mooncake import store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake Store is not installed ({exc}): run tests/cluster/run.sh, or pip install 'kvtier[cluster]'"
    if master_binary() is None:
        return "the mooncake_master binary is not beside the mooncake package"
    return None


def master_binary() -> str | None:
    import mooncake

    path = pathlib.Path(mooncake.__file__).parent / "mooncake_master"
    return str(path) if path.exists() else shutil.which("mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _started(proc: Proc, ready: Callable[[], bool], timeout: float) -> None:
    """Poll until a started process is ready (a port open, a file written); fail at once if it exits instead."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}): see {proc.log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} not ready within {timeout:.0f} s: see {proc.log}")
        time.sleep(0.05)  # polling a real condition


def _listens(proc: Proc, port: int) -> bool:
    """Whether `proc` itself listens on TCP `port`: a port that merely answers may be another process's (a free
    port picked for this cluster and taken meanwhile), and a test would then stop or kill a process that serves
    nothing."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    fd_dir = f"/proc/{proc.popen.pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except FileNotFoundError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{fd_dir}/{fd}") in inodes:
                return True
        except FileNotFoundError:
            continue
    return False


@dataclasses.dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: pathlib.Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.popen.wait(timeout=10)

    @contextlib.contextmanager
    def stopped(self, timeout_s: float = 10.0) -> Iterator[None]:
        """SIGSTOP the process and, once every thread of it reads stopped in /proc (a test's partition starts
        then, not when the signal was sent), run the block; SIGCONT after it, however it ends."""
        assert self.popen.poll() is None, f"{self.name} exited ({self.popen.returncode}) before it was stopped"
        self.popen.send_signal(signal.SIGSTOP)
        try:
            _started(self, lambda: all_threads_stopped(self.popen.pid), timeout_s)
            yield
        finally:
            self.popen.send_signal(signal.SIGCONT)


class MooncakeCluster:
    """Processes of one loopback cluster, all ended by close(). Masters and holders log into `workdir`."""

    def __init__(self, workdir: pathlib.Path, *, lease_ms: int = 200, client_ttl_s: int = 3) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.lease_ms, self.client_ttl_s = lease_ms, client_ttl_s
        self._ports: set[int] = set()
        self.metadata_port = self._port()
        self.metadata = f"http://127.0.0.1:{self.metadata_port}/metadata"
        self.master_port = self._port()
        self.masters: list[Proc] = []
        self.holders: list[Proc] = []
        self.etcd: Proc | None = None
        self.etcd_endpoint = ""
        self.admin_ports: list[int] = []  # each master's HTTP admin server (/get_all_keys for `kvtier audit`)
        self._n = 0

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def admin(self) -> str:
        """The masters' admin servers as `[cluster] admin` takes them."""
        return ";".join(f"http://127.0.0.1:{p}" for p in self.admin_ports)

    def _port(self) -> int:
        """A free port not yet given to this cluster: free_port releases what it finds, so the kernel may hand the
        same port out again before the process it was meant for binds it (a master once got its metadata port as
        its admin port, and exited on "Address already in use")."""
        while (port := free_port()) in self._ports:
            pass
        self._ports.add(port)
        return port

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        self._n += 1
        log = self.workdir / f"{self._n:02d}-{name}.log"
        env = {**os.environ, **LOOPBACK_ENV, "PYTHONPATH": str(REPO)}
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return Proc(name, popen, log)

    def start_master(self, *, ha: bool = False) -> Proc:
        """One master; with `ha`, one of several electing a leader over etcd (start_etcd first)."""
        rpc_port = self._port() if ha else self.master_port
        argv = [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}"]
        argv += [f"--client_ttl={self.client_ttl_s}", f"--default_kv_lease_ttl={self.lease_ms}"]
        self.admin_ports.append(self._port())
        argv += ["--metrics_host=127.0.0.1", f"--metrics_port={self.admin_ports[-1]}"]  # its admin server, else :9003
        if not ha:  # the master also serves the transfer engine's metadata (HA masters keep it in etcd)
            argv += ["--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1"]
            argv += [f"--http_metadata_server_port={self.metadata_port}"]
        if ha:
            argv += ["--enable_ha=true", "--ha_backend_type=etcd", f"--ha_backend_connstring={self.etcd_endpoint}"]
            argv += ["--enable_oplog=true"]
        proc = self._spawn(f"master{len(self.masters)}", argv)
        self.masters.append(proc)
        if ha and len(self.masters) > 1:  # a standby opens its port only once elected
            _started(proc, lambda: b"HotStandbyService started" in proc.log.read_bytes(), 20)
        else:
            _started(proc, lambda: _listens(proc, rpc_port), 20)
        return proc

    def start_etcd(self) -> Proc:
        client, peer = self._port(), self._port()
        self.etcd_endpoint = f"127.0.0.1:{client}"
        argv = [shutil.which("etcd") or "etcd", "--data-dir", str(self.workdir / "etcd"), "--name", "kvtier-test"]
        argv += [
            "--listen-client-urls",
            f"http://{self.etcd_endpoint}",
            "--advertise-client-urls",
            f"http://{self.etcd_endpoint}",
        ]
        argv += [
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
        ]
        argv += ["--initial-cluster", f"kvtier-test=http://127.0.0.1:{peer}"]
        etcd = self.etcd = self._spawn("etcd", argv)
        _started(etcd, lambda: _listens(etcd, client), 20)
        # The transfer engine's metadata in etcd too: served by a master, it would die with the leader, and a node
        # that had not yet looked up a holder's segment could never transfer from it again.
        self.metadata = f"etcd://{self.etcd_endpoint}"
        return self.etcd

    def start_holder(self, segment_bytes: int = 64 << 20, *, master: str | None = None) -> Proc:
        ready = self.workdir / f"holder-{self._n + 1}.ready"
        argv = [
            sys.executable,
            str(pathlib.Path(__file__).with_name("mooncake_holder.py")),
            self.metadata,
            master or self.master,
            str(segment_bytes),
            str(ready),
        ]
        proc = self._spawn(f"holder{len(self.holders)}", argv)
        self.holders.append(proc)
        _started(proc, ready.exists, 30)
        return proc

    def segments_expired(self) -> int:
        """Holder segments the masters unmounted after their holder stopped answering (client_ttl)."""
        return sum(m.log.read_bytes().count(b"action=unmount_expired_mem_segment") for m in self.masters)

    def close(self) -> None:
        for proc in [*self.holders, *self.masters, *([self.etcd] if self.etcd else [])]:
            with contextlib.suppress(ProcessLookupError):
                if proc.popen.poll() is None:
                    os.kill(proc.popen.pid, signal.SIGCONT)  # a SIGSTOPped master must be able to die
                proc.kill(signal.SIGKILL)


@contextlib.contextmanager
def mooncake_cluster(
    workdir: pathlib.Path, holders: int = 2, segment_bytes: int = 64 << 20, **kw: int
) -> Iterator[MooncakeCluster]:
    cluster = MooncakeCluster(workdir, **kw)
    try:
        cluster.start_master()
        for _ in range(holders):
            cluster.start_holder(segment_bytes)
        yield cluster
    finally:
        cluster.close()
