"""The `[cluster]` settings: where the cluster is, how much to wait for it, and what goes down to it.

In `core` because the daemon's config (`kvtier.core.config`) parses them; `kvtier.cluster` runs on them.
Off by default: the embedded and systemd defaults are single-node.
"""

from __future__ import annotations

import dataclasses
import enum

from kvtier.core.config_schema import default
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
    """`[cluster]`: one node's view of the cluster. The defaults (the schema's, which says what each key does)
    suit one master on loopback (tests, a single host). Built in code, the checks below name the key."""

    enabled: bool = default("cluster.enabled")
    backend: str = default("cluster.backend")
    master: str = default("cluster.master")
    etcd: str = default("cluster.etcd")
    metadata: str = default("cluster.metadata")
    admin: str = default("cluster.admin")
    local_hostname: str = default("cluster.local_hostname")
    protocol: str = default("cluster.protocol")
    device: str = default("cluster.device")
    key_prefix: str = default("cluster.key_prefix")
    replicas: int = default("cluster.replicas")
    lookup_timeout_s: float = default("cluster.lookup_timeout_s")
    load_timeout_s: float = default("cluster.load_timeout_s")
    put_timeout_s: float = default("cluster.put_timeout_s")
    retry_s: float = default("cluster.retry_s")
    probe_s: float = default("cluster.probe_s")
    staging_bytes: int = default("cluster.staging_bytes")
    transfer_buffer_bytes: int = default("cluster.transfer_buffer_bytes")
    write_through: WriteThrough = WriteThrough(default("cluster.write_through"))  # noqa: RUF009 (an enum: immutable)
    queue_bytes: int = default("cluster.queue_bytes")
    promote: bool = default("cluster.promote")

    def __post_init__(self) -> None:
        if isinstance(self.write_through, str):  # as the config file and the schema spell it
            object.__setattr__(self, "write_through", WriteThrough(self.write_through))

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
