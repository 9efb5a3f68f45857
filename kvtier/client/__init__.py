"""What an inference engine links: attach, lookup (check vector + leases), load, read, release, offload, prewarm."""

from kvtier.client.client import (
    Attachment,
    Client,
    Lease,
    LoadReport,
    LookupResult,
    OffloadReport,
    PrewarmReport,
    default_socket,
)
from kvtier.daemon.errors import DaemonBusy, DaemonUnavailable, OutOfOrder, PermissionDenied, RemoteError

__all__ = [
    "Attachment",
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
    "default_socket",
]
