"""The cluster tier: Mooncake Store below the local disk, behind the same LowerTier interface (docs/cluster.md)."""

from kvtier.cluster.config import ClusterConfig, WriteThrough
from kvtier.cluster.errors import (
    ClusterConfigError,
    ClusterError,
    ClusterPutError,
    ClusterRequestError,
    ClusterSetupError,
    ClusterUnavailable,
)
from kvtier.cluster.stats import ChainStats, ClusterStats, Histogram
from kvtier.cluster.tier import ClusterTier

__all__ = [
    "ChainStats",
    "ClusterConfig",
    "ClusterConfigError",
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
