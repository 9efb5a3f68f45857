"""The cluster client as a link that may not be up yet: connected at start, or later by a background retry.

A daemon must start (and serve node-local hits) while its cluster is down; until the client connects,
every cluster call is `ClusterUnavailable`, which the tier turns into misses. A missing Mooncake install
is not retried: it is a setup error at start.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable

from kvtier.cluster.errors import ClusterSetupError, ClusterUnavailable
from kvtier.cluster.mooncake_client import MooncakeClient, require_mooncake
from kvtier.core.cluster_config import ClusterConfig

log = logging.getLogger(__name__)


class ClientLink:
    """Holds the MooncakeClient once one is set up; connects in a background thread, retrying until it is.

    Mooncake's setup against a master that does not answer retries for longer than any of kvtier's deadlines
    before failing, and holds the GIL meanwhile (the whole daemon would stop): so the master (or etcd) and the
    metadata server are first probed with a plain TCP connect, and setup is called only once they accept.
    The constructor waits at most `load_timeout_s` for the first attempt.
    """

    def __init__(self, cfg: ClusterConfig, connect: Callable[[ClusterConfig], MooncakeClient] = MooncakeClient) -> None:
        require_mooncake()
        self.cfg = cfg
        self._connect = connect
        self._client: MooncakeClient | None = None
        self._closed = threading.Event()
        self._attempted = threading.Event()
        self.last_error = "connecting"
        self._thread = threading.Thread(target=self._run, name="kvtier-cluster-connect", daemon=True)
        self._thread.start()
        if not self._attempted.wait(cfg.load_timeout_s) or self._client is None:
            log.warning(
                "cluster at %s not connected yet (%s): serving node-local, connecting in the background",
                cfg.master_address,
                self.last_error,
            )

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                probe(self.cfg)
                client = self._connect(self.cfg)
            except ClusterSetupError as exc:
                self.last_error = str(exc)
                log.info("cluster setup failed, retrying in %gs: %s", self.cfg.retry_s, exc)
                self._attempted.set()
                self._closed.wait(self.cfg.retry_s)
                continue
            if self._closed.is_set():  # closed while connecting
                client.close()
                return
            self._client = client
            self.last_error = ""
            self._attempted.set()
            log.info("cluster connected at %s", self.cfg.master_address)
            self._probe_while_open(client)
            return

    def _probe_while_open(self, client: MooncakeClient) -> None:
        """Keep the link's health at most `probe_s` old: when no call has had an answer for `probe_s` (an idle
        node, or one whose calls fail at once while it is marked down), one probe; at most one per `probe_s`.
        A data call that ran out of time wakes it at once (`Breaker.suspect`): at most as often as calls time out,
        and a lane's calls run one after another, so at most one per lane per deadline."""
        every = self.cfg.probe_s
        wake = client.breaker.wake
        was_up = True
        while not self._closed.is_set():
            woken = wake.wait(max(0.01, every - client.breaker.quiet_s))
            wake.clear()
            if self._closed.is_set():
                return
            if not woken and client.breaker.quiet_s < every:
                continue  # traffic answered meanwhile: that is the health
            try:
                client.probe()
            except Exception as exc:  # anything the library raises is a failed probe, never a dead prober
                client.breaker.failed(f"probe raised {type(exc).__name__}: {exc}")
            if client.breaker.up != was_up:
                was_up = client.breaker.up
                log.warning("cluster at %s is %s", self.cfg.master_address, "up" if was_up else f"DOWN: {self.why}")

    @property
    def client(self) -> MooncakeClient:
        """The connected client; ClusterUnavailable (a miss for the caller) while there is none."""
        client = self._client
        if client is None:
            raise ClusterUnavailable(f"cluster not connected yet: {self.last_error}")
        return client

    @property
    def up(self) -> bool:
        """Connected, the last answer a success, and that answer recent: a prober that stopped (it should not)
        must not leave an old "up" standing."""
        client = self._client
        if client is None:
            return False
        stale = client.breaker.quiet_s > 2 * (self.cfg.probe_s + self.cfg.lookup_timeout_s) + 1.0
        return client.breaker.up and not stale

    @property
    def why(self) -> str:
        """Why the link is not up ("" when it is)."""
        client = self._client
        if client is None:
            return f"not connected: {self.last_error}"
        if not client.breaker.up:
            return client.breaker.why
        if not self.up:
            return f"no answer from the cluster for {client.breaker.quiet_s:.1f} s"
        return ""

    def close(self) -> None:
        """Close the client; an attempt still blocked in Mooncake's setup is left to end on its own (daemon thread)."""
        self._closed.set()
        if self._client is not None:
            self._client.breaker.wake.set()  # the prober waits on it
        self._thread.join(timeout=1.0)
        if self._client is not None:
            self._client.close()
            self._client = None


def _endpoints(cfg: ClusterConfig) -> tuple[list[str], str]:
    """host:port of the masters (or their etcd endpoints), and of the metadata server (HTTP or etcd; "" for others)."""
    masters = cfg.etcd.split(";") if cfg.etcd else [cfg.master]
    url = urllib.parse.urlsplit(cfg.metadata)
    return [m.strip() for m in masters if m.strip()], (url.netloc if url.scheme in ("http", "etcd") else "")


# connect() fails with EPERM when the host's policy drops the packet: a systemd unit's IPAddressDeny= (the
# shipped kvtier.service allows localhost only) or a firewall rule. Said in the error, since the link retries.
_POLICY = (
    ": connect() refused with EPERM by this host's policy (a systemd unit's IPAddressDeny=: see docs/systemd.md, "
    "'A cluster node')"
)


def _accepts(endpoint: str, timeout_s: float) -> str | None:
    """None when the endpoint accepts a TCP connection, else why not ("" or the policy note)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except PermissionError:
        return _POLICY
    except (OSError, ValueError):
        return ""


def probe(cfg: ClusterConfig) -> None:
    """ClusterSetupError unless a master (or etcd) endpoint and the metadata server accept a TCP connection."""
    masters, metadata = _endpoints(cfg)
    timeout = min(1.0, cfg.load_timeout_s)
    refused = [_accepts(m, timeout) for m in masters]
    if None not in refused:
        first = max((r for r in refused if r is not None), default="")
        raise ClusterSetupError(f"no master at {cfg.master_address} accepts connections{first}")
    if metadata and (why := _accepts(metadata, timeout)) is not None:
        raise ClusterSetupError(f"the metadata server {cfg.metadata} does not accept connections{why}")
