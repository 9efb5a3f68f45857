"""Recovery (lower tier -> pool) for one CacheManager (the write-back, pool -> lower tier: `writeback`).

It runs bulk I/O outside the manager's lock on slots no one else may touch: a recovery's slots are RECOVERING.
Every step under the lock first checks that the topology has not moved since (a resize drops every slot, so their
results would land nowhere).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.core.checkvector import CheckVector
from kvtier.core.forms import Reason, Route
from kvtier.core.loadbatch import LoadBatch, TargetGroup
from kvtier.core.tier import LoadRequest
from kvtier.gpu.context import ManagerContext, PoolLookup
from kvtier.gpu.errors import AdmissionRefused, StaleHandle
from kvtier.gpu.leases import LeaseSet
from kvtier.gpu.states import BlockState
from kvtier.gpu.table import IN_FLIGHT

log = logging.getLogger(__name__)

# enum members as plain ints for the per-object paths (an enum attribute lookup is a descriptor call each time)
_OK, _MISSING, _EVICTED = int(Reason.OK), int(Reason.MISSING), int(Reason.EVICTED)
_REUSE = int(Route.REUSE)
_FREE = BlockState.FREE


@dataclasses.dataclass(slots=True)
class Claimed:
    """Slots claimed (RECOVERING, verdict IN_FLIGHT) for objects of a lease, and the requests that fill them;
    one entry per object, in the same order."""

    groups: np.ndarray
    blocks: np.ndarray
    slots: np.ndarray
    requests: LoadBatch
    started: float

    def joined(self, other: Claimed) -> Claimed:
        """This claim's objects, then `other`'s (claimed while this one's were loading)."""
        return Claimed(
            np.concatenate((self.groups, other.groups)),
            np.concatenate((self.blocks, other.blocks)),
            np.concatenate((self.slots, other.slots)),
            self.requests + other.requests,
            self.started,
        )


# A recovery claims its first objects' slots (about this many bytes of them) and hands them to the lower tier before
# it claims the rest, which it does once the tier has their reads under way (`LowerTier.load_into`'s `more`): the
# disk reads while the slots are claimed. Claiming a DSV4 daemon load's objects, with evictions, is a small part of the
# load, and a few MiB is enough reading to cover it on a disk of gigabytes a second.
FIRST_CLAIM_BYTES = 4 << 20
# ... and at most this many objects: the store looks the first objects up before their reads go out, so thousands of
# small ones (a ref-tiny prefix: about 1 KB each, and nothing for the disk to overlap) would only delay the first read.
FIRST_CLAIM_OBJECTS = 64


class Recovery:
    """The manager's lower-tier paths; runs under (and between holds of) the context's lock."""

    def __init__(self, context: ManagerContext) -> None:
        self._c = context

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
                    pending = np.argwhere(result.check_vector.routes.T == Route.RECOVER)[:, ::-1]  # (g, b), block-major
                if not len(pending):
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

    def _round(self, lease: LeaseSet, pending: np.ndarray, deadline: float, epoch: int, adopted: list[int]) -> None:
        """Resolve every pending (group, block): adopt, wait for another recovery, or load in capped batches."""
        c = self._c
        waiting: list[tuple[int, int]] = []
        at = 0
        while at < len(pending):
            with c.cond:
                self._require_current(lease, epoch)
                room = c.cfg.max_recovering - c.table.n_recovering
                if room <= 0:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:  # the rest is recomputed; what others are loading is still awaited below
                        _fail(lease, pending[at:, 0], pending[at:, 1], Reason.ADMISSION)
                        break
                    c.cond.wait(min(remaining, 0.05))
                    continue
                chunk = pending[at : at + room]
                at += len(chunk)
                first = self._first(chunk[:, 0])
                claimed, rest = self._claim(lease, chunk[:first, 0], chunk[:first, 1], adopted, waiting), chunk[first:]
                if claimed is None and len(rest):  # none of the first objects loads: nothing to overlap
                    claimed, rest = self._claim(lease, rest[:, 0], rest[:, 1], adopted, waiting), rest[:0]
            if claimed is None:
                continue
            later = self._later(lease, rest, epoch, adopted, waiting) if len(rest) else None
            claimed, answers = self._load(claimed, later)
            with c.cond:
                if c.topology_epoch != epoch:
                    raise StaleHandle("the pools were resized during recovery; look the prefix up again")
                # the slots are settled even if the lease died meanwhile: nothing stays RECOVERING
                self._finish(lease, claimed, answers)
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
                        self._adopt(lease, np.array([g]), np.array([b]))
                    else:
                        _fail(lease, g, b, Reason(int(verdict)))
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _fail(lease, g, b, Reason.ADMISSION)
                    return
                c.cond.wait(min(remaining, 0.05))

    def _claim(
        self,
        lease: LeaseSet,
        gs: np.ndarray,
        bs: np.ndarray,
        adopted: list[int],
        waiting: list[tuple[int, int]],
    ) -> Claimed | None:
        """Decide a batch of pending objects: adopt those resident now, fail those that cannot load, queue those
        another recovery is loading on `waiting`, and claim a slot for each of the rest (None if none)."""
        c = self._c
        if lease.namespace != c.ns:  # the version moved since the lookup: never load stale objects
            _fail(lease, gs, bs, Reason.STALE_VERSION)
            return None
        t = c.table
        for b in sorted(set(bs[lease.rows[bs] == t.sentinel].tolist())):
            try:
                row = t.row(lease.block_hashes[b])
            except AdmissionRefused:
                continue  # its objects stay on the sentinel row and fail below
            lease.rows[b] = row
            t.hold_row(row)  # keeps the new row indexed until the lease holds it
            adopted.append(row)
        rows = lease.rows[bs]
        no_row = rows == t.sentinel  # the block index had no room for its hash
        verdict = t.e_verdict[gs, rows]
        ok = (verdict == _OK) & ~no_row
        self._adopt(lease, gs[ok], bs[ok])
        flight = (verdict == IN_FLIGHT) & ~no_row
        waiting += zip(gs[flight].tolist(), bs[flight].tolist())
        load = ((verdict == _MISSING) | (verdict == _EVICTED)) & ~no_row
        _fail(lease, gs[no_row], bs[no_row], Reason.ADMISSION)
        other = ~(ok | flight | load | no_row)
        for g, b, v in zip(gs[other].tolist(), bs[other].tolist(), verdict[other].tolist()):
            _fail(lease, g, b, Reason(v))
        gs, bs, rows = gs[load], bs[load], rows[load]
        if not len(gs):
            return None
        again = _repeats(gs * (t.sentinel + 1) + rows)  # a hash the lookup named twice loads once; the rest wait
        if again.any():
            waiting += zip(gs[again].tolist(), bs[again].tolist())
            gs, bs, rows = gs[~again], bs[~again], rows[~again]
        slots = c.space.allocate_many(gs, c.ns_id)
        refused = slots < 0
        _fail(lease, gs[refused], bs[refused], Reason.ADMISSION)
        gs, bs, rows, slots = gs[~refused], bs[~refused], rows[~refused], slots[~refused]
        local, aligned = c.space.locals(gs, slots)  # layer 4: never load into a slot that is not aligned and whole
        if not aligned.all():
            log.error("refusing to recover into %d misaligned slots", int((~aligned).sum()))
            for g, slot in zip(gs[~aligned].tolist(), slots[~aligned].tolist()):
                c.space.unallocate(g, slot)
            _fail(lease, gs[~aligned], bs[~aligned], Reason.MISALIGNED)
            gs, bs, rows, slots, local = gs[aligned], bs[aligned], rows[aligned], slots[aligned], local[aligned]
        if not len(gs):
            return None
        t.bind_recovering(slots, rows, c.ns_id)
        r_hash = t.r_hash
        requests = LoadBatch(c.ns, self._targets(), gs, [r_hash[row] for row in rows.tolist()], local)
        return Claimed(gs, bs, slots, requests, time.monotonic())

    def _targets(self) -> tuple[TargetGroup, ...]:
        """The groups, as the namespace's loads are bound for them."""
        c = self._c
        return tuple(
            TargetGroup(name, form, digest, pool.tensor, pool.slot_stride, pool.slot_nbytes)
            for name, form, digest, pool in zip(c.names, c.forms, c.digests, c.pools)
        )

    def _first(self, groups: np.ndarray) -> int:
        """How many of a batch's objects (their groups, in claim order) to claim first: those of its first
        FIRST_CLAIM_BYTES, at most FIRST_CLAIM_OBJECTS; all of them in a batch of FIRST_CLAIM_BYTES or less."""
        nbytes = np.cumsum(np.array([p.slot_nbytes for p in self._c.pools])[groups])
        if nbytes[-1] <= FIRST_CLAIM_BYTES:  # all of it is read about as soon as the first part would be
            return len(groups)
        return min(int(np.searchsorted(nbytes, FIRST_CLAIM_BYTES)) + 1, FIRST_CLAIM_OBJECTS)

    def _later(
        self, lease: LeaseSet, rest: np.ndarray, epoch: int, adopted: list[int], waiting: list[tuple[int, int]]
    ) -> Callable[[], Claimed | None]:
        """Claims `rest` (pending (group, block) pairs) when called, as `_round` would have: None if nothing is
        claimed, and nothing is while the lease or the topology has moved on (the pairs stay pending, so the next
        `_require_current` raises)."""

        def claim() -> Claimed | None:
            c = self._c
            with c.cond:
                if c.topology_epoch != epoch or not lease.live:
                    return None
                return self._claim(lease, rest[:, 0], rest[:, 1], adopted, waiting)

        return claim

    def _load(self, claimed: Claimed, later: Callable[[], Claimed | None] | None) -> tuple[Claimed, np.ndarray]:
        """Load the claimed objects, and those `later` claims when the tier asks for more: everything claimed, and
        an answer for each."""
        extra: list[Claimed] = []

        def more() -> Sequence[LoadRequest]:
            got = later() if later is not None else None
            if got is None:
                return []
            extra.append(got)
            return got.requests

        try:
            lower = self._c.tier_below()
            answers: list[Reason] | None = list(
                lower.load_into(claimed.requests, more) if later else lower.load_into(claimed.requests)
            )
        except Exception:
            log.exception("lower tier failed to load %d objects; they will be recomputed", len(claimed.requests))
            answers = None
        for got in extra:  # (also after an exception: what was claimed is settled)
            claimed = claimed.joined(got)
        n = len(claimed.requests)
        if answers is not None and len(answers) != n:
            log.error("lower tier answered %d of %d loads; treating them as failed", len(answers), n)
            answers = None
        if answers is None:
            return claimed, np.full(n, int(Reason.CORRUPT))
        return claimed, np.array([int(a) for a in answers], dtype=np.int64)

    def _finish(self, lease: LeaseSet, claimed: Claimed, answers: np.ndarray) -> None:
        """RECOVERING -> SEALED after a verified load (layer 1: the tier filled the whole slot from a
        complete record; layer 2: the record's layout digest is the live one; layer 4: checked at claim),
        else -> FREE and the object is recomputed."""
        c = self._c
        t = c.table
        ok = answers == _OK
        good = claimed.slots[ok]
        t.seal_recovered(good, c.ns_id)
        if lease.live:
            self._adopt(lease, claimed.groups[ok], claimed.blocks[ok])
        gform = np.asarray(c.gform)[claimed.groups[ok]]
        c.counters.recovered(gform, np.full(len(good), time.monotonic() - claimed.started))
        for g, b, slot, answer in zip(
            claimed.groups[~ok].tolist(), claimed.blocks[~ok].tolist(), claimed.slots[~ok].tolist(), answers[~ok]
        ):
            t.move(slot, _FREE)
            c.space.free(slot, Reason.MISSING)
            c.counters.event("recovers_failed", c.gform[g])
            _fail(lease, g, b, Reason(int(answer)))

    def _adopt(self, lease: LeaseSet, gs: np.ndarray, bs: np.ndarray) -> None:
        """Route resident objects REUSE at the generation they have now."""
        lease.gens[gs, bs] = self._c.table.e_gen[gs, lease.rows[bs]]
        lease.routes[gs, bs] = _REUSE
        lease.reasons[gs, bs] = _OK

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


def _fail(lease: LeaseSet, g: int | np.ndarray, b: int | np.ndarray, reason: Reason) -> None:
    """Route one object (or arrays of them, all for the same reason) RECOMPUTE."""
    lease.routes[g, b] = Route.RECOMPUTE
    lease.reasons[g, b] = reason if reason != Reason.OK else Reason.MISSING


def _repeats(keys: np.ndarray) -> np.ndarray:
    """True at every entry whose key occurred earlier in `keys`."""
    order = np.argsort(keys, kind="stable")
    out = np.zeros(len(keys), dtype=bool)
    out[order[1:]] = keys[order[1:]] == keys[order[:-1]]
    return out
