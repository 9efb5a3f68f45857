"""The tier below the daemon's pools: the local DiskStore, or, with `[cluster] enabled`, the chain
local disk -> cluster (Mooncake Store) over it (docs/cluster.md).

Everything that reads or writes objects below the pools (the managers' recovery and write-back, the raw
tier ops, prewarm's pins) goes through this one object; the store keeps its other jobs (namespaces,
limits, stats, the verifier's view).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from kvtier.core.config import DaemonConfig
from kvtier.core.tier import LowerTier
from kvtier.daemon.events import EventPublisher, ObservedCluster
from kvtier.store import DiskStore

if TYPE_CHECKING:  # the cluster's modules load torch: imported only where the cluster is enabled
    from kvtier.cluster.chain import TierChain

log = logging.getLogger(__name__)


def build_lower(cfg: DaemonConfig, store: DiskStore, events: EventPublisher | None = None) -> LowerTier:
    """`store` alone (single node, the default), or the tier chain over it when the cluster is enabled.

    A cluster that is down at start does not stop the daemon: it serves node-local hits and connects
    when the cluster answers (ClusterTier's link retries). A missing Mooncake install is an error here.
    """
    c = cfg.cluster
    if not c.enabled:
        return store
    from kvtier.cluster import ClusterTier
    from kvtier.cluster.chain import TierChain

    cluster = ClusterTier(c)
    # with [events] on, the cluster's copies are published too (their writes and removals, medium kvtier_cluster)
    chain = TierChain(store, cluster if events is None else ObservedCluster(cluster, events), c)  # type: ignore[arg-type]
    log.info(
        "cluster tier: mooncake at %s, %d replicas, write-through %s, promote %s",
        c.master_address,
        c.replicas,
        c.write_through.value,
        c.promote,
    )
    return chain


def _chain(lower: LowerTier) -> TierChain | None:
    """The tier chain, or None on a single node, where `build_lower` returned the store itself (and the cluster's
    modules were never imported: this never imports them either)."""
    if isinstance(lower, DiskStore):
        return None
    from kvtier.cluster.chain import TierChain

    return lower if isinstance(lower, TierChain) else None


def cluster_doc(lower: LowerTier) -> dict[str, Any]:
    """The cluster tier's own stats document (ChainStats as plain data) for `kvtier status`; {} on a single node."""
    chain = _chain(lower)
    return msgspec.to_builtins(chain.stats()) if chain is not None else {}


def cluster_problem(lower: LowerTier) -> str:
    """Why the configured cluster is not serving ("" on a single node or while it is up): degraded health,
    never unhealthy, since the node keeps serving its own pools and disk."""
    chain = _chain(lower)
    if chain is None or chain.cluster.up:
        return ""
    why = chain.cluster.stats().why_down
    return f"cluster down ({why}): serving node-local" if why else "cluster down: serving node-local"


def close_lower(lower: LowerTier, timeout_s: float) -> None:
    """Finish queued write-through / promotions for up to `timeout_s` and close the cluster client (not the store)."""
    chain = _chain(lower)
    if chain is not None:
        chain.close(timeout_s)
