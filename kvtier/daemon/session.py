"""What one connection is to the daemon (`Session`), and what the server asks of the backend behind it (`Backend`).

Its own module so the server and the backend both build on it without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvtier.wire import messages as P

if TYPE_CHECKING:  # the server serves before the pools (and torch) are loaded
    from kvtier.daemon.runtime import Runtime


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int


@dataclasses.dataclass(slots=True)
class Session:
    """What one connection has done so far; `owner` names its leases in the backend."""

    owner: int
    peer: Peer
    requests: int = 0
    attached: str | None = None
    namespace: bytes = b""  # the namespace its pools served when this connection attached
    runtime: Runtime | None = None  # the pools it mapped at attach (live or canary; they stay its pools)
    tier_open: bool = False


class Backend(Protocol):
    """What the server asks of the composed gpu + store backend (`kvtier.daemon.backend.DaemonBackend`)."""

    def attach(self, session: Session, req: P.Attach) -> tuple[P.AttachOk, list[int]]: ...
    def lookup(self, session: Session, req: P.Lookup) -> P.LookupOk: ...
    def release(self, session: Session, req: P.Release) -> P.Released: ...
    def load(self, session: Session, req: P.Load) -> P.LoadOk: ...
    def offload(self, session: Session, req: P.Offload) -> P.OffloadOk: ...
    def seal(self, session: Session, req: P.Seal, fds: Sequence[int] = ()) -> P.SealOk: ...
    def renew(self, session: Session, req: P.Renew) -> P.Renewed: ...
    def flush(self, session: Session, req: P.Flush) -> P.FlushOk: ...
    def prewarm(self, session: Session, req: P.Prewarm) -> P.PrewarmOk: ...
    def explain(self, session: Session, req: P.Explain) -> P.ExplainOk: ...
    def release_owner(self, owner: int) -> int: ...
    def stale_reply(self, session: Session, req: P.Msg) -> P.Msg | None: ...
    def namespaces(self, session: Session, req: P.Msg) -> P.NamespacesOk: ...
    def engine_op(self, session: Session, req: P.EngineNamespaces | P.EngineKeys) -> P.Msg: ...

    @property
    def tier(self) -> TierService: ...


class TierService(Protocol):
    """The raw tier ops (`kvtier.daemon.tier_ops.TierOps`): a client's own keys over the store."""

    def open(self, session: Session, req: P.TierOpen, fds: list[int]) -> P.TierOpenOk: ...
    def has(self, session: Session, req: P.TierHas) -> P.TierReasons: ...
    def keys(self, session: Session, req: P.TierKeys) -> P.TierKeyPage: ...
    def store_many(self, session: Session, req: P.TierStore) -> P.TierStored: ...
    def load(self, session: Session, req: P.TierLoad) -> P.TierReasons: ...
