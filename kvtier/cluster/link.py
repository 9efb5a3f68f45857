"""The cluster client as a link that may not be up yet: connected at start, or later by a background retry.

A daemon must start (and serve node-local hits) while its cluster is down; until the client connects,
every cluster call is `ClusterUnavailable`, which the tier turns into misses. A missing Mooncake install
is not retried: it is a setup error at start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.cluster.errors import ClusterSetupError, ClusterUnavailable
from kvtier.cluster.mooncake_client import MooncakeClient, require_mooncake
from kvtier.core.cluster_config import ClusterConfig

log = logging.getLogger(__name__)


class ClientLink:
    """Holds the MooncakeClient once one is set up; retries `connect` every `retry_s` until then."""

    def __init__(self, cfg: ClusterConfig, connect: Callable[[ClusterConfig], MooncakeClient] = MooncakeClient) -> None:
        require_mooncake()
        self.cfg = cfg
        self._connect = connect
        self._client: MooncakeClient | None = None
        self._closed = threading.Event()
        self.last_error = ""
        self._thread: threading.Thread | None = None
        if not self._try():
            self._thread = threading.Thread(target=self._retry, name="kvtier-cluster-connect", daemon=True)
            self._thread.start()

    def _try(self) -> bool:
        try:
            client = self._connect(self.cfg)
        except ClusterSetupError as exc:
            if not self.last_error:
                log.warning(
                    "cluster not reachable, serving node-local until it is (retry every %gs): %s", self.cfg.retry_s, exc
                )
            self.last_error = str(exc)
            return False
        if self._closed.is_set():  # closed while connecting
            client.close()
            return True
        self._client = client
        if self.last_error:
            log.info("cluster connected at %s", self.cfg.master_address)
        self.last_error = ""
        return True

    def _retry(self) -> None:
        while not self._closed.wait(self.cfg.retry_s):
            if self._try():
                return

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def client(self) -> MooncakeClient:
        """The connected client; ClusterUnavailable (a miss for the caller) while there is none."""
        client = self._client
        if client is None:
            raise ClusterUnavailable(f"cluster not connected yet: {self.last_error}")
        return client

    @property
    def up(self) -> bool:
        client = self._client
        return client is not None and client.breaker.up

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.put_timeout_s)
        if self._client is not None:
            self._client.close()
            self._client = None
