"""The `[cluster]` settings: where the cluster is, how much to wait for it, and what goes down to it.

In `core` because the daemon's config (`kvtier.core.config`) parses them; `kvtier.cluster` runs on them.
Off by default: the embedded and systemd defaults are single-node.
"""

from __future__ import annotations

import dataclasses
import enum

from kvtier.core.errors import ConfigError
from kvtier.core.forms import CacheForm


class WriteThrough(enum.Enum):
    """Which offloads also go to the cluster (in the background, once the local store has decided on them).

    There is no history-only choice: a hit needs every state group at its boundary, so history without the
    state objects of a checkpoint gives another node no usable hit at all (docs/cluster.md, "What goes down").
    """

    OFF = "off"
    ALL = "all"  # every object offloaded: history, and the state objects engines store at their checkpoints

    def covers(self, form: CacheForm) -> bool:
        return self is WriteThrough.ALL


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One node's view of the cluster. The defaults suit one master on loopback (tests, a single host)."""

    enabled: bool = False
    backend: str = "mooncake"
    master: str = "127.0.0.1:50051"  # host:port of the master; ignored when `etcd` is set
    etcd: str = ""  # etcd endpoints of HA masters ("host:port;host:port"); the client follows the leader
    metadata: str = "http://127.0.0.1:8080/metadata"  # the transfer engine's metadata server
    # the masters' HTTP admin servers (Mooncake's --metrics_port), "http://host:port;...": `kvtier audit --cluster`
    # lists the cluster's keys there (the client API cannot list); "" audits what this node's store wrote through
    admin: str = ""
    local_hostname: str = "127.0.0.1"  # the address other nodes reach this node's transfer engine at
    protocol: str = "tcp"
    device: str = ""  # RDMA devices for protocol "rdma"
    key_prefix: str = "kvt1"  # namespaces kvtier's objects among others in a shared cluster
    replicas: int = 1
    lookup_timeout_s: float = 0.2  # one batched existence call
    load_timeout_s: float = 5.0  # one batch of gets
    put_timeout_s: float = 10.0  # one batch of background puts
    retry_s: float = 2.0  # after a failure, how long calls answer "unavailable" at once before one probes again
    # an idle link is probed (one existence call) this often, so `up` (status, metrics, health) says within
    # probe_s + lookup_timeout_s that the cluster stopped or started answering, with no traffic to tell
    probe_s: float = 1.0
    staging_bytes: int = 64 << 20  # registered buffer per direction; the largest object (plus header) must fit
    transfer_buffer_bytes: int = 16 << 20  # the client's own transfer buffer (Mooncake local_buffer_size)
    write_through: WriteThrough = WriteThrough.ALL
    queue_bytes: int = 256 << 20  # write-through / promotion backlog; beyond it offloads are dropped (counted)
    promote: bool = True  # a load from the cluster is also stored on local disk (in the background)

    def __post_init__(self) -> None:
        def bad(key: str, message: str) -> ConfigError:
            return ConfigError(message, key=f"cluster.{key}")

        if self.backend != "mooncake":
            raise bad("backend", f"{self.backend!r} is not supported: use 'mooncake'")
        if self.protocol not in ("tcp", "rdma"):
            raise bad("protocol", f"must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not 1 <= self.replicas <= 16:
            raise bad("replicas", f"must be 1..16, got {self.replicas}")
        for name in ("lookup_timeout_s", "load_timeout_s", "put_timeout_s", "retry_s", "probe_s"):
            if not getattr(self, name) > 0:
                raise bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.staging_bytes < 1 << 20:
            raise bad("staging_bytes", f"must be >= 1 MiB, got {self.staging_bytes}")
        if self.queue_bytes < 0:
            raise bad("queue_bytes", f"must be >= 0, got {self.queue_bytes}")
        if not self.key_prefix or "/" in self.key_prefix:
            raise bad("key_prefix", f"{self.key_prefix!r} must be non-empty and contain no '/'")

    @property
    def master_address(self) -> str:
        """What the Mooncake client connects to: the master itself, or etcd where HA masters elect a leader."""
        return f"etcd://{self.etcd}" if self.etcd else self.master
