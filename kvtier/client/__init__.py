"""What an inference engine links: attach, lookup (check vector + leases), load, read, release, offload, prewarm;
`TierClient` for an engine that brings its own keys (the daemon's store as its disk tier)."""

from kvtier.client.client import (
    Attachment,
    Client,
    Lease,
    LoadReport,
    LookupResult,
    OffloadReport,
    PrewarmReport,
)
from kvtier.client.tier import TierClient
from kvtier.daemon.connection import default_socket
from kvtier.daemon.errors import BadRange, DaemonBusy, DaemonUnavailable, OutOfOrder, PermissionDenied, RemoteError

__all__ = [
    "Attachment",
    "BadRange",
    "Client",
    "DaemonBusy",
    "DaemonUnavailable",
    "Lease",
    "LoadReport",
    "LookupResult",
    "OffloadReport",
    "OutOfOrder",
    "PermissionDenied",
    "PrewarmReport",
    "RemoteError",
    "TierClient",
    "default_socket",
]
