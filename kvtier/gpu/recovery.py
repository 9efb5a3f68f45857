"""Recovery (lower tier -> pool) and write-back (pool -> lower tier) for one CacheManager.

Both run bulk I/O outside the manager's lock on slots no one else may touch: a recovery's slots are
RECOVERING, a write-back's are pinned. Every step under the lock first checks that the topology
has not moved since (a resize drops every slot, so their results would land nowhere).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import deque

import numpy as np
import torch

from kvtier.core.checkvector import CheckVector
from kvtier.core.errors import LayoutError, VersionError
from kvtier.core.forms import CacheForm, Reason, Route
from kvtier.core.tier import LoadRequest, LowerTier, ObjectKey
from kvtier.gpu.context import ManagerContext, PoolLookup
from kvtier.gpu.errors import AdmissionRefused, StaleHandle
from kvtier.gpu.leases import LeaseSet
from kvtier.gpu.states import BlockState
from kvtier.gpu.table import IN_FLIGHT

log = logging.getLogger(__name__)

# enum members as plain ints for the per-object paths (an enum attribute lookup costs ~1.5 us on 3.11)
_OK, _MISSING, _EVICTED = int(Reason.OK), int(Reason.MISSING), int(Reason.EVICTED)
_REUSE = int(Route.REUSE)
_RECOVERING, _FREE = BlockState.RECOVERING, BlockState.FREE


class Settled(enum.Enum):
    """A claim that loads nothing now."""

    DONE = enum.auto()  # adopted (already resident) or failed on the spot
    WAIT = enum.auto()  # another recovery is loading the object: wait for its verdict


@dataclasses.dataclass(frozen=True, slots=True)
class PendingLoad:
    """A slot claimed (RECOVERING) for one object of a lease, and the request that fills it."""

    group: int
    block: int
    slot: int
    request: LoadRequest
    started: float


Claim = PendingLoad | Settled


class Recovery:
    """The manager's lower-tier paths; runs under (and between holds of) the context's lock."""

    def __init__(self, context: ManagerContext) -> None:
        self._c = context

    @property
    def _lower(self) -> LowerTier:
        lower = self._c.lower
        assert lower is not None, "the manager recovers and writes back only with a lower tier"
        return lower

    # -- recovery -----------------------------------------------------------------------------------

    def recover(self, result: PoolLookup, timeout_s: float | None) -> PoolLookup:
        """See `CacheManager.recover`."""
        c = self._c
        lease = result.leases
        deadline = time.monotonic() + (c.cfg.recover_wait_s if timeout_s is None else timeout_s)
        with c.lock:
            c.expire(c.clock())
            c.require_live(lease)
            epoch = c.topology_epoch
            adopted: list[int] = []
        try:
            while True:
                with c.lock:
                    self._require_current(lease, epoch)
                    self._rebuild(result)  # objects evicted since the lookup turn RECOMPUTE first
                    pending = [(int(g), int(b)) for b, g in np.argwhere(result.check_vector.routes.T == Route.RECOVER)]
                if not pending:
                    return result
                self._round(lease, pending, deadline, epoch, adopted)
        finally:
            with c.lock:
                if c.topology_epoch == epoch:
                    t = c.table
                    for row in adopted:
                        if t.let_go_row(row):
                            lease.rows[lease.rows == row] = t.sentinel
                c.unreserve(lease)

    def _require_current(self, lease: LeaseSet, epoch: int) -> None:
        self._c.require_live(lease)
        if self._c.topology_epoch != epoch:
            raise StaleHandle("the pools were resized during recovery; look the prefix up again")

    def _round(
        self, lease: LeaseSet, pending: list[tuple[int, int]], deadline: float, epoch: int, adopted: list[int]
    ) -> None:
        """Resolve every pending (group, block): adopt, wait for another recovery, or load in capped batches."""
        c = self._c
        todo = deque(pending)
        waiting: list[tuple[int, int]] = []
        while todo:
            batch: list[PendingLoad] = []
            with c.cond:
                self._require_current(lease, epoch)
                while todo and c.table.n_recovering < c.cfg.max_recovering:
                    g, b = todo.popleft()
                    claim = self._claim(lease, g, b, adopted)
                    if claim is Settled.WAIT:
                        waiting.append((g, b))
                    elif isinstance(claim, PendingLoad):
                        batch.append(claim)
                if not batch and todo:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        for g, b in todo:
                            _fail(lease, g, b, Reason.ADMISSION)
                        todo.clear()
                    else:
                        c.cond.wait(min(remaining, 0.05))
                    continue
            if batch:
                answers = self._load([load.request for load in batch])
                with c.cond:
                    if c.topology_epoch != epoch:
                        raise StaleHandle("the pools were resized during recovery; look the prefix up again")
                    # the slots are settled even if the lease died meanwhile: nothing stays RECOVERING
                    ok = [load for load, answer in zip(batch, answers) if not self._finish(lease, load, answer)]
                    now = time.monotonic()
                    c.counters.recovered([c.gform[load.group] for load in ok], [now - load.started for load in ok])
                    c.cond.notify_all()
        for g, b in waiting:
            self._await(lease, g, b, deadline, epoch)

    def _await(self, lease: LeaseSet, g: int, b: int, deadline: float, epoch: int) -> None:
        """Wait for another recovery's verdict on (g, b), then adopt or fail it."""
        c = self._c
        with c.cond:
            while True:
                self._require_current(lease, epoch)
                verdict = c.table.e_verdict[g, lease.rows[b]]
                if verdict != IN_FLIGHT:
                    if verdict == Reason.OK:
                        self._adopt(lease, g, b)
                    else:
                        _fail(lease, g, b, Reason(int(verdict)))
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _fail(lease, g, b, Reason.ADMISSION)
                    return
                c.cond.wait(min(remaining, 0.05))

    def _claim(self, lease: LeaseSet, g: int, b: int, adopted: list[int]) -> Claim:
        """Decide one pending object: settled now, wait for another recovery, or a slot to load into."""
        c = self._c
        if lease.namespace != c.ns:  # the version moved since the lookup: never load stale objects
            _fail(lease, g, b, Reason.STALE_VERSION)
            return Settled.DONE
        t = c.table
        row = int(lease.rows[b])
        if row == t.sentinel:
            try:
                row = t.row(lease.block_hashes[b])
            except AdmissionRefused:
                _fail(lease, g, b, Reason.ADMISSION)
                return Settled.DONE
            lease.rows[b] = row
            t.hold_row(row)  # keeps the new row indexed until the lease holds it
            adopted.append(row)
        verdict = int(t.e_verdict[g, row])
        if verdict == _OK:
            self._adopt(lease, g, b)
            return Settled.DONE
        if verdict == IN_FLIGHT:
            return Settled.WAIT
        if verdict != _MISSING and verdict != _EVICTED:
            _fail(lease, g, b, Reason(verdict))
            return Settled.DONE
        try:
            slot = c.space.allocate(g, c.ns_id)
        except AdmissionRefused:
            _fail(lease, g, b, Reason.ADMISSION)
            return Settled.DONE
        try:
            local = c.space.local(g, slot)  # layer 4: never load into a slot that is not aligned and whole
        except LayoutError:
            log.exception("refusing to recover into a misaligned slot")
            c.space.unallocate(g, slot)
            _fail(lease, g, b, Reason.MISALIGNED)
            return Settled.DONE
        t.move(slot, _RECOVERING)
        t.bind(slot, row, IN_FLIGHT, c.ns_id)
        key = ObjectKey(c.ns, t.r_hash[row], c.names[g], c.forms[g])
        request = LoadRequest(key, c.pools[g].slot_view(local), c.digests[g])
        return PendingLoad(g, b, slot, request, time.monotonic())

    def _load(self, requests: list[LoadRequest]) -> list[Reason]:
        try:
            answers = list(self._lower.load_into(requests))
        except Exception:
            log.exception("lower tier failed to load %d objects; they will be recomputed", len(requests))
            return [Reason.CORRUPT] * len(requests)
        if len(answers) != len(requests):
            log.error("lower tier answered %d of %d loads; treating them as failed", len(answers), len(requests))
            return [Reason.CORRUPT] * len(requests)
        return [Reason(a) for a in answers]

    def _finish(self, lease: LeaseSet, load: PendingLoad, answer: Reason) -> bool:
        """RECOVERING -> SEALED after a verified load (layer 1: the tier filled the whole slot from a
        complete record; layer 2: the record's layout digest is the live one; layer 4: checked at claim),
        else -> FREE and the object is recomputed (True: it failed; the caller counts the good ones)."""
        c = self._c
        t = c.table
        if answer == _OK:
            t.seal(load.slot, c.ns_id, recoverable=True)
            if lease.live:
                self._adopt(lease, load.group, load.block)
            return False
        t.move(load.slot, _FREE)
        c.space.free(load.slot, Reason.MISSING)
        c.counters.event("recovers_failed", c.gform[load.group])
        _fail(lease, load.group, load.block, answer)
        return True

    def _adopt(self, lease: LeaseSet, g: int, b: int) -> None:
        lease.gens[g, b] = self._c.table.e_gen[g, lease.rows[b]]
        lease.routes[g, b] = _REUSE
        lease.reasons[g, b] = _OK

    def _rebuild(self, result: PoolLookup) -> None:
        """Re-intersect after recovery; objects evicted since the lookup turn RECOMPUTE `evicted`."""
        c = self._c
        lease = result.leases
        k = result.check_vector.hit_blocks
        current = c.table.e_gen.take(lease.rows[:k], axis=1)
        moved = (lease.routes[:, :k] == Route.REUSE) & (current != lease.gens[:, :k])
        lease.routes[:, :k][moved] = Route.RECOMPUTE
        lease.reasons[:, :k][moved] = Reason.EVICTED
        result.check_vector = CheckVector.build(c.geometry, lease.routes, lease.reasons)
        # hold the new hit before letting go of the old one: a row kept indexed only by this lease
        # must not be unindexed (and its row reused by another hash) in between
        old_rows, old_slots = lease.held_rows, lease.held_slots
        c.hold(lease, result.check_vector)
        c.table.let_go(old_rows, old_slots)

    # -- write-back ---------------------------------------------------------------------------------

    def backlog(self) -> np.ndarray:
        """Sealed objects of the live namespace not yet in the lower tier, per group."""
        c = self._c
        t = c.table
        todo = (t.s_state == BlockState.SEALED) & ~t.s_recoverable & (t.s_ns == c.ns_id)
        return np.bincount(t.s_group[todo], minlength=t.n_groups)

    def persist(self, limit: int | None, skip: frozenset[CacheForm]) -> PersistOutcome:
        """See `CacheManager.persist`. Each form is stored in its own batch (up to `limit` objects), so a
        form the tier refuses (its quota, say) does not hold back the others."""
        c = self._c
        with c.lock:
            t = c.table
            epoch = c.topology_epoch
            todo = (t.s_state == BlockState.SEALED) & ~t.s_recoverable & (t.s_ns == c.ns_id)
            batches: dict[CacheForm, list[tuple[int, int, ObjectKey, torch.Tensor, bytes]]] = {}
            for form in dict.fromkeys(c.forms):
                if form in skip:
                    continue
                groups = [g for g, f in enumerate(c.forms) if f is form]
                mine = np.flatnonzero(todo & np.isin(t.s_group, groups))[:limit]
                work = batches.setdefault(form, [])
                for slot in mine.tolist():
                    g = int(t.s_group[slot])
                    t.pin(slot)  # no eviction may reuse the slot while its bytes are being stored
                    key = ObjectKey(c.ns, t.r_hash[t.s_row[slot]], c.names[g], c.forms[g])
                    local = slot - int(t.base[g])
                    work.append((slot, int(t.s_gen[slot]), key, c.pools[g].slot_view(local), c.digests[g]))
        outcome = PersistOutcome()
        done: list[tuple[int, int, bool]] = []
        for form, work in batches.items():
            if not work:
                continue
            try:
                self._lower.store_many([(key, view, digest) for _, _, key, view, digest in work])
                ok = True
                outcome.stored += len(work)
            except VersionError as exc:  # a rollout retired the namespace since the batch was taken: stale now
                log.info("write-back of %d %s objects skipped: %s", len(work), form.value, exc)
                ok = False
            except Exception as exc:
                log.warning("write-back of %d %s objects failed: %s", len(work), form.value, exc)
                outcome.failed[form] = f"{type(exc).__name__}: {exc}"
                ok = False
            done.extend((slot, gen, ok) for slot, gen, *_ in work)
        with c.lock:
            if c.topology_epoch != epoch:
                return PersistOutcome()
            t = c.table
            for slot, gen, ok in done:
                if t.s_gen[slot] == gen:
                    t.unpin(slot)
                    if ok:
                        t.mark_recoverable(slot)
        return outcome


@dataclasses.dataclass(slots=True)
class PersistOutcome:
    """What one write-back batch did: objects stored, and per form the tier refused, why."""

    stored: int = 0
    failed: dict[CacheForm, str] = dataclasses.field(default_factory=dict)


def _fail(lease: LeaseSet, g: int, b: int, reason: Reason) -> None:
    lease.routes[g, b] = Route.RECOMPUTE
    lease.reasons[g, b] = reason if reason != Reason.OK else Reason.MISSING
