"""What the manager, its offload path (`writes`) and its lower-tier paths (`recovery`, `writeback`) share.

One per CacheManager: the lock and its condition, the live version, the slot space of the current
topology, the lease book and the recovery queue, and the few operations on them that more than one
part needs (expiring leases, holding a hit, checking an object key). The parts each hold this object;
none of them imports the manager.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from kvtier.core.checkvector import CheckVector, HitGeometry
from kvtier.core.errors import VersionError
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.profile import ModelProfile
from kvtier.core.tier import LowerTier, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.gpu.admission import AdmissionConfig
from kvtier.gpu.coordinator import Coordinator
from kvtier.gpu.counters import Counters
from kvtier.gpu.errors import BadKey, StaleHandle
from kvtier.gpu.leases import LeaseBook, LeaseSet, WriteHandle
from kvtier.gpu.slots import SlotSpace
from kvtier.gpu.states import BlockState

log = logging.getLogger(__name__)
NO_ROWS = np.zeros(0, dtype=np.intp)


@dataclasses.dataclass(slots=True)
class PoolLookup:
    """What a lookup of the pools answers: the check vector and the lease that keeps its REUSE objects
    readable (the daemon's client sees its own `kvtier.client.LookupResult`)."""

    check_vector: CheckVector
    leases: LeaseSet


class ManagerContext:
    """The shared state of one CacheManager; every method runs under `lock` (re-entrant)."""

    def __init__(
        self,
        profile: ModelProfile,
        *,
        device: torch.device,
        lower: LowerTier | None,
        cfg: AdmissionConfig,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.device = device
        self.lower = lower
        self.cfg = cfg
        self.ttl = ttl
        self.clock = clock
        self.names = tuple(g.name for g in profile.groups)
        self.group_ix = {name: i for i, name in enumerate(self.names)}
        self.forms = tuple(g.form for g in profile.groups)
        self.coordinator = Coordinator(profile, cfg.state_probe_boundaries)
        self.counters = Counters(self.forms)
        self.geometry = HitGeometry.of(profile)
        self.book = LeaseBook()
        self.queued = 0  # places in the recovery queue reserved by live leases
        self.topology_epoch = 0
        self.ns_ids: dict[bytes, int] = {}
        self.profile = profile
        self.use_version(profile.version)

    # -- version and topology -----------------------------------------------------------------------

    def use_version(self, version: VersionKey) -> None:
        self.profile = dataclasses.replace(self.profile, version=version)
        self.ns = version.namespace
        self.ns_id = self.ns_ids.setdefault(self.ns, len(self.ns_ids))
        self.digests = tuple(self.profile.layout(g).digest for g in self.profile.groups)

    def build(self, budgets_bytes: Mapping[CacheForm | str, int]) -> SlotSpace | None:
        """Allocate the slot space of a topology from byte budgets; returns the one it replaces (or None)."""
        old = getattr(self, "space", None)
        budgets = {CacheForm(k): int(v) for k, v in budgets_bytes.items()}
        self.space = SlotSpace(self.profile, budgets, self.device, self.cfg, self.counters)
        # the slot space's parts, named once: every path reads them
        self.pools = self.space.pools
        self.table = self.space.table
        self.quotas = self.space.quotas
        self.gform = self.space.gform
        return old

    def tier_below(self) -> LowerTier:
        """The lower tier, for the paths that run only with one (recovery, write-back)."""
        assert self.lower is not None, "the manager recovers and writes back only with a lower tier"
        return self.lower

    def group(self, name: str) -> int:
        g = self.group_ix.get(name)
        if g is None:
            raise BadKey(f"profile {self.profile.name} has no group {name!r} (groups: {', '.join(self.names)})")
        return g

    def check_key(self, key: ObjectKey) -> int:
        g = self.group_ix.get(key.group)
        if g is None or self.forms[g] is not key.form:
            raise BadKey(
                f"profile {self.profile.name} has no {key.form.value} group {key.group!r}; name a group of the profile"
            )
        if key.namespace != self.ns:
            raise VersionError(
                f"namespace {key.namespace.hex()} is not live ({self.ns.hex()}); write under the live version key"
            )
        return g

    def slot_of(self, key: ObjectKey) -> int:
        """The slot holding `key`'s object now, or -1. Caller holds the lock."""
        g = self.check_key(key)
        row = self.table.index.get(key.block_hash)
        return -1 if row is None else int(self.table.e_slot[g, row])

    # -- leases -------------------------------------------------------------------------------------

    def require_live(self, lease: LeaseSet) -> None:
        if not lease.live:
            raise StaleHandle("the lease was released or expired; look the prefix up again")

    def hold(self, lease: LeaseSet, cv: CheckVector) -> None:
        """Protect the hit: history objects of its rows, state objects of its window, from pressure eviction."""
        k = cv.hit_blocks
        held = lease.rows[:k].copy()
        lease.held_slots = self.coordinator.hold(self.table, lease.rows, cv.routes, k)
        lease.held_rows = held

    def release_lease(self, lease: LeaseSet) -> None:
        lease.live = False
        self.table.let_go(lease.held_rows, lease.held_slots)
        lease.held_rows = NO_ROWS
        lease.held_slots = []
        self.book.drop(lease.lease_id)
        self.unreserve(lease)

    def unreserve(self, lease: LeaseSet) -> None:
        """Give the lease's places in the recovery queue back (a recovery ended, or the lease did)."""
        self.queued -= lease.reserved
        lease.reserved = 0
        self.cond.notify_all()

    def expire(self, now: float) -> None:
        """End every lease and write handle whose time ran out."""
        for ident in self.book.due(now):
            lease = self.book.leases.get(ident)
            if lease is not None:
                self.release_lease(lease)
                self.counters.totals["leases_expired"] += 1
                log.debug("lease %d of %r expired after %.1f s without release", ident, lease.owner, self.ttl)
            else:
                self.abort_write(self.book.writes[ident][0])
                self.counters.totals["writes_expired"] += 1

    def abort_write(self, handle: WriteHandle) -> None:
        """Forget a write handle and free its slot if it is still the one being written (idempotent)."""
        self.book.drop(handle.write_id)
        g = self.group_ix[handle.key.group]
        t = self.table
        slot = int(t.base[g]) + handle.slot
        if t.s_gen[slot] == handle.generation and t.s_state[slot] == BlockState.WRITING:
            t.move(slot, BlockState.FREE)
            self.space.free(slot, Reason.MISSING)
            self.counters.event("writes_aborted", self.gform[g])
