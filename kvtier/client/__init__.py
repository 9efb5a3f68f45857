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
from kvtier.client.errors import TierFull
from kvtier.client.tier import TierClient
from kvtier.core.errors import NotDurable, StaleHandle
from kvtier.core.not_durable import NotDurableCause, NotDurableCount
from kvtier.wire import (
    BadRange,
    DaemonBusy,
    DaemonTimeout,
    DaemonUnavailable,
    OutOfOrder,
    PermissionDenied,
    RemoteError,
    WrongType,
    default_socket,
)

__all__ = [
    "Attachment",
    "BadRange",
    "Client",
    "DaemonBusy",
    "DaemonTimeout",
    "DaemonUnavailable",
    "Lease",
    "LoadReport",
    "LookupResult",
    "NotDurable",
    "NotDurableCause",
    "NotDurableCount",
    "OffloadReport",
    "OutOfOrder",
    "PermissionDenied",
    "PrewarmReport",
    "RemoteError",
    "StaleHandle",
    "TierClient",
    "TierFull",
    "WrongType",
    "default_socket",
]
