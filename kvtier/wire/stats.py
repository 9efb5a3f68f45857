"""The daemon's stats document, typed: what `stats` answers, what `kvtier status` renders, what metrics export.

Field names are the document's keys (`kvtier status --json` prints it as is). `store` stays the store's own
document (`kvtier.store.DiskStore.stats`, plus the daemon's persist counters): the store owns its keys.
"""

from __future__ import annotations

from typing import Any

import msgspec


class LatencyHistogram(msgspec.Struct):
    """Cumulative buckets [(upper bound in seconds or "+Inf", count)], as Prometheus wants them."""

    buckets: list[tuple[float | str, int]]
    sum: float
    count: int


class FormStats(msgspec.Struct):
    """One form's lookup routes, recoveries and evictions, summed over the served profiles."""

    lookups: int = 0
    reuse: int = 0
    recover: int = 0
    recompute: int = 0
    recover_ok: int = 0
    recover_failed: int = 0
    admission_rejections: int = 0
    evictions: int = 0
    recompute_reasons: dict[str, int] = {}
    recovery_latency: LatencyHistogram | None = None

    @property
    def needed(self) -> int:
        """Objects lookups needed: state objects outside the window at the hit were never needed."""
        return self.reuse + self.recover + self.recompute - self.recompute_reasons.get("outside_window", 0)

    def share(self, route: str) -> float | None:
        """Share of the needed objects that got `route` (reuse / recover / recompute); None before any lookup."""
        needed = self.needed
        if not needed:
            return None
        count = getattr(self, route) - (self.recompute_reasons.get("outside_window", 0) if route == "recompute" else 0)
        return count / needed


class PoolStats(msgspec.Struct):
    slots: int = 0
    bytes: int = 0
    used: int = 0
    quota: int = 0
    pages: str = ""  # how the form's pools got their pages (kvtier.core.hugepages.SharedPages values, or device)
    moving_bytes: int = 0  # bytes of them not yet tried by the move onto huge pages (MADV_COLLAPSE; 0: done or none)


class ProfileStats(msgspec.Struct):
    name: str
    namespace: str
    hash_block_tokens: int
    device: str
    pools: dict[str, PoolStats]
    live_leases: int
    recovering: int
    leases_expired: int


class NamespaceStats(msgspec.Struct):
    """One namespace the store knows: `state` live (a profile's live version), canary (served beside it as
    `<profile>@canary`), retired (its records read stale_version; the verifier reclaims them), or store (live
    in the store but no profile's pools: raw tier clients such as vLLM's, or a profile no longer served)."""

    namespace: str  # hex
    state: str
    profile: str  # the profile serving it, "" for store / retired
    model: str  # the version key's model id
    records: int
    bytes: int


class EngineNamespaceStats(msgspec.Struct):
    """What engines' tiers (vLLM, SGLang: the raw tier ops) did in one namespace since the daemon started.

    `namespace` is "other" for the namespaces past the first `kvtier.daemon.tier_stats.MAX_NAMESPACES` seen
    (their counts summed there), which bounds the metrics' label values."""

    namespace: str  # hex, or "other"
    engine: str  # vllm, sglang or other: from the namespace's kernel ABI
    model: str  # the version key's model id
    connections: int = 0  # tier connections open on it now
    lookups: int = 0  # objects asked about (tier_has)
    hits: int = 0  # of those, present and usable
    loads: int = 0  # objects loaded and verified
    load_failures: int = 0  # objects a load could not serve (missing, evicted, corrupt, ...)
    bytes_loaded: int = 0
    stores: int = 0  # objects handed to the store (stored, or already there)
    bytes_stored: int = 0


class EventStats(msgspec.Struct):
    """The KV-events publisher (`[events]`); absent from the document when it is off."""

    endpoint: str
    replay_endpoint: str
    topic: str
    batches: int  # batches sent (the next sequence number)
    stored: int  # BlockStored events in them
    removed: int  # BlockRemoved events in them
    dropped: int  # events dropped because the publisher's queue was full
    replays: int  # replay requests answered


class DaemonInfo(msgspec.Struct):
    version: str
    pid: int
    uptime_s: float
    health: str  # "ok" or "degraded: <why>"
    config_source: str
    socket: str
    connections: int
    metrics: str = ""  # HOST:PORT of the metrics endpoint, "" when off
    # the pools: "none" (no profiles: an engine-only node), "waiting" / "allocating" (tier ops and status are
    # served meanwhile; an attach waits), "ready", or "failed: <why>"
    pools: str = "ready"
    startup: dict[str, float] = {}  # phase -> seconds since the process started (kvtier.daemon.startup_phases)


class VerifierReport(msgspec.Struct):
    """The supervisor's view (mode, state, pid, restarts) laid over what the verifier last published."""

    mode: str = "off"
    state: str = "not running"
    restarts: int = 0
    pid: int | None = None
    last_exit: int | None = None
    phase: str = "never ran"
    running: bool = False
    ready: bool = False
    verifier_pid: int | None = None
    heartbeat_age_s: float | None = None
    sweep: dict[str, Any] = {}
    actions: dict[str, int] = {}
    settings: dict[str, Any] = {}  # the verifier's rates and sweep interval
    paced_busy: bool = False  # its last read was paced at the busy rate: others were using the disk


class Reloadable(msgspec.Struct):
    """What SIGHUP re-reads, as now in force."""

    store_budget_bytes: int
    store_quota_bytes: dict[str, int]
    verifier_rate_bytes_per_s: int
    verifier_sweep_interval_s: float


class PinStats(msgspec.Struct):
    """One prewarm's pins: its objects stay in the pool (and on disk) until they expire."""

    profile: str
    objects: int
    expires_in_s: float


class StatsDoc(msgspec.Struct):
    profiles: list[ProfileStats]
    forms: dict[str, FormStats]
    store: dict[str, Any]
    prewarm_pins: int
    verifier: VerifierReport
    daemon: DaemonInfo | None = None  # filled by the service around the backend's part
    reloadable: Reloadable | None = None
    pins: list[PinStats] = []  # the live prewarm pins, soonest expiry first
    cluster: dict[str, Any] = {}  # the cluster tier's own document (kvtier.cluster.ChainStats); {} on a single node
    namespaces: list[NamespaceStats] = []  # every namespace of the store, with its state and bytes
    engines: list[EngineNamespaceStats] = []  # what engines' tiers did, per namespace
    events: EventStats | None = None  # the KV-events publisher; None when [events] is off
