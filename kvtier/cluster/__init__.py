"""The cluster tier: Mooncake Store below the local disk, behind the same LowerTier interface (docs/cluster.md)."""

from kvtier.cluster.errors import (
    ClusterError,
    ClusterPutError,
    ClusterRequestError,
    ClusterSetupError,
    ClusterUnavailable,
)
from kvtier.cluster.stats import ChainStats, ClusterStats, Histogram
from kvtier.cluster.tier import ClusterTier
from kvtier.core.cluster_config import ClusterConfig, WriteThrough

__all__ = [
    "ChainStats",
    "ClusterConfig",
    "ClusterError",
    "ClusterPutError",
    "ClusterRequestError",
    "ClusterSetupError",
    "ClusterStats",
    "ClusterTier",
    "ClusterUnavailable",
    "Histogram",
    "WriteThrough",
]
