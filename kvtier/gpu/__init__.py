"""The GPU-resident cache manager: pools per cache group, per-form managers behind a coordinator,
the block state machine, four-layer validation, leases, admission caps and static topology."""

from kvtier.gpu.admission import AdmissionConfig
from kvtier.gpu.errors import (
    AdmissionRefused,
    BadKey,
    BudgetError,
    IllegalTransition,
    PartialBlock,
    StaleHandle,
    TopologyError,
)
from kvtier.gpu.leases import Handle, LeaseSet, WriteHandle
from kvtier.gpu.manager import CacheManager, PoolLookup
from kvtier.gpu.page_move import PageMove
from kvtier.gpu.pools import Pool
from kvtier.gpu.states import BlockState, CacheBlockState

__all__ = [
    "AdmissionConfig",
    "AdmissionRefused",
    "BadKey",
    "BlockState",
    "BudgetError",
    "CacheBlockState",
    "CacheManager",
    "Handle",
    "IllegalTransition",
    "LeaseSet",
    "PageMove",
    "PartialBlock",
    "Pool",
    "PoolLookup",
    "StaleHandle",
    "TopologyError",
    "WriteHandle",
]
