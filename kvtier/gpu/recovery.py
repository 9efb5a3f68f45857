"""Recovery (lower tier -> pool) and write-back (pool -> lower tier) for one CacheManager.

Both run bulk I/O outside the manager's lock on slots no one else may touch: a recovery's slots are
RECOVERING, a write-back's are pinned. Every step under the lock first checks that the topology
has not moved since (a resize drops every slot, so their results would land nowhere).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.core.checkvector import CheckVector
from kvtier.core.errors import OutOfRoom, RoomLeft, VersionError
from kvtier.core.forms import CacheForm, Reason, Route
from kvtier.core.loadbatch import LoadBatch, TargetGroup
from kvtier.core.tier import LoadRequest, LowerTier, ObjectKey
from kvtier.gpu.context import ManagerContext, PoolLookup
from kvtier.gpu.errors import AdmissionRefused, StaleHandle
from kvtier.gpu.leases import LeaseSet
from kvtier.gpu.refusal_log import RefusalLog
from kvtier.gpu.states import BlockState
from kvtier.gpu.table import IN_FLIGHT

log = logging.getLogger(__name__)

# enum members as plain ints for the per-object paths (an enum attribute lookup is a descriptor call each time)
_OK, _MISSING, _EVICTED = int(Reason.OK), int(Reason.MISSING), int(Reason.EVICTED)
_REUSE = int(Route.REUSE)
_FREE = BlockState.FREE


# A write-back pins at most this share of each group's pool (at least one slot) while it stores them: the rest stays
# evictable, so a recovery meanwhile finds its victims. Unbounded, one batch of 32 pinned every unpersisted slot of a
# 16-slot pool, and a restore in that moment was recomputed (RECOMPUTE admission). Pools of thousands of slots never
# reach it.
WRITE_BACK_PIN_SHARE = 0.25


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
        self._refusals = RefusalLog()

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
            lower = self._lower
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

    # -- write-back ---------------------------------------------------------------------------------

    def backlog(self) -> np.ndarray:
        """Sealed objects of the live namespace not yet in the lower tier, per group."""
        c = self._c
        t = c.table
        todo = (t.s_state == BlockState.SEALED) & ~t.s_recoverable & (t.s_ns == c.ns_id)
        return np.bincount(t.s_group[todo], minlength=t.n_groups)

    def persist(
        self,
        limit: int | None,
        skip: frozenset[CacheForm],
        only: Sequence[ObjectKey] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> PersistOutcome:
        """See `CacheManager.persist_batch`. Each round takes a batch of each form (up to `limit` objects in all)
        and stores them in one batch of the tier (one sync and one commit for all the forms, which a durable
        offload waits for); where the tier refuses that, each form's batch is stored alone, so a form the tier
        refuses (its quota, say) does not hold back the others. A batch pins at most `WRITE_BACK_PIN_SHARE` of
        each group's pool, and the call takes batches until done, or until `until()` says to end between two."""
        outcome = PersistOutcome()
        left: dict[CacheForm, int | None] = {f: limit for f in dict.fromkeys(self._c.forms) if f not in skip}
        while left:
            if not self._persist_round(left, outcome, only, until) or (until is not None and until()):
                break
        return outcome

    def _persist_round(
        self,
        left: dict[CacheForm, int | None],
        outcome: PersistOutcome,
        only: Sequence[ObjectKey] | None,
        until: Callable[[], bool] | None,
    ) -> bool:
        """One batch per form in `left` (each at most its count left, None: no limit; of the objects in `only`
        where given); forms that are done (all they had, or their limit), or that the tier refused or skipped,
        leave `left`. Where the tier refused the forms together, each is stored alone, and once `until()` says so
        the forms not stored yet are left for the next call, untried. False when nothing was taken, or the
        topology moved (that round then counts for nothing, as its slots are gone)."""
        c = self._c
        with c.lock:
            t = c.table
            epoch = c.topology_epoch
            todo = (t.s_state == BlockState.SEALED) & ~t.s_recoverable & (t.s_ns == c.ns_id)
            if only is not None:
                todo &= self._holding(only, len(todo))
            batches: dict[CacheForm, list[tuple[int, int, ObjectKey, torch.Tensor, bytes]]] = {}
            more: dict[CacheForm, bool] = {}  # whether the pin share left some of the form's objects for a next round
            for form in list(left):
                mine, more[form] = self._within_share(todo, form)
                mine = mine[: left[form]]
                if not len(mine):
                    del left[form]
                    continue
                work = batches[form] = []
                for slot in mine.tolist():
                    g = int(t.s_group[slot])
                    t.pin(slot)  # no eviction may reuse the slot while its bytes are being stored
                    key = ObjectKey(c.ns, t.r_hash[t.s_row[slot]], c.names[g], c.forms[g])
                    local = slot - int(t.base[g])
                    work.append((slot, int(t.s_gen[slot]), key, c.pools[g].slot_view(local), c.digests[g]))
        done: list[tuple[int, int, bool]] = []
        stored = 0
        failed: dict[CacheForm, str] = {}
        refused_objects: dict[CacheForm, int] = {}
        out_of_room: dict[CacheForm, RoomLeft] = {}
        together = self._store_together(batches) if len(batches) > 1 else None
        for form, work in batches.items():
            refusal = together if isinstance(together, _Refusal) else None
            if refusal is None and together is not True:
                if done and until is not None and until():  # each alone is a sync and a commit that one waits for
                    done.extend((slot, gen, False) for slot, gen, *_ in work)
                    continue
                try:
                    self._lower.store_many([(key, view, digest) for _, _, key, view, digest in work])
                except VersionError as exc:  # a rollout retired the namespace since the batch was taken: stale now
                    log.info("write-back of %d %s objects skipped: %s", len(work), form.value, exc)
                    del left[form]
                    done.extend((slot, gen, False) for slot, gen, *_ in work)
                    continue
                except Exception as exc:
                    refusal = _Refusal.of(exc)
            if refusal is None:
                self._refusals.stored(form)
                stored += len(work)
                n = left[form]
                if not more[form] or (n is not None and n <= len(work)):
                    del left[form]  # done: everything it had, or its limit
                elif n is not None:
                    left[form] = n - len(work)
            else:
                self._refusals.refused(form, len(work), refusal.kind, refusal.why)
                failed[form] = refusal.why
                refused_objects[form] = len(work)
                if refusal.left is not None:
                    out_of_room[form] = refusal.left
                del left[form]
            done.extend((slot, gen, refusal is None) for slot, gen, *_ in work)
        with c.lock:
            if c.topology_epoch != epoch:  # a resize dropped every slot: this round's results land nowhere
                return False
            t = c.table
            for slot, gen, ok in done:
                if t.s_gen[slot] == gen:
                    t.unpin(slot)
                    if ok:
                        t.mark_recoverable(slot)
        outcome.stored += stored
        outcome.failed.update(failed)
        outcome.refused_objects.update(refused_objects)
        outcome.out_of_room.update(out_of_room)
        return bool(batches)

    def _store_together(
        self, batches: dict[CacheForm, list[tuple[int, int, ObjectKey, torch.Tensor, bytes]]]
    ) -> bool | _Refusal | None:
        """Store every form's batch in one batch of the tier: True if it took them; None if it refused (all or
        nothing: nothing of them went in, and each form's batch is then tried alone, to learn which forms it
        refuses and why). A refusal by the whole tier's budget with no room left at all is returned instead, for
        every form: each alone would be refused the same, and on a full store every such try costs the daemon an
        admission."""
        try:
            self._lower.store_many(
                [(key, view, digest) for work in batches.values() for _, _, key, view, digest in work]
            )
        except Exception as exc:
            refusal = _Refusal.of(exc)
            if refusal.left is not None and refusal.left.limit == "budget" and refusal.left.exhausted:
                return refusal
            log.debug("write-back of %d forms in one batch refused (%s): storing each form alone", len(batches), exc)
            return None
        return True

    def _holding(self, keys: Sequence[ObjectKey], n_slots: int) -> np.ndarray:
        """A mask of the slots holding `keys`' objects now (keys of a namespace no longer live hold none).
        Caller holds the lock."""
        c = self._c
        mask = np.zeros(n_slots, dtype=bool)
        for key in keys:
            if key.namespace == c.ns and (slot := c.slot_of(key)) >= 0:
                mask[slot] = True
        return mask

    def _within_share(self, todo: np.ndarray, form: CacheForm) -> tuple[np.ndarray, bool]:
        """The form's slots to store (`todo`), at most `WRITE_BACK_PIN_SHARE` of each of its groups' pools, and
        whether the share left some out. Caller holds the lock."""
        c = self._c
        taken, cut = [], False
        for g, pool in enumerate(c.pools):
            if c.forms[g] is form:
                base = int(c.table.base[g])
                share = max(1, int(pool.n_slots * WRITE_BACK_PIN_SHARE))
                slots = base + np.flatnonzero(todo[base : base + pool.n_slots])
                cut |= len(slots) > share
                taken.append(slots[:share])
        return np.concatenate(taken), cut


@dataclasses.dataclass(slots=True)
class PersistOutcome:
    """What one persist call did: objects stored, and per form the tier refused, why, how many objects the
    refused batch held and, where it was refused for want of room, what the tier said of it (`RoomLeft`: which
    limit, the room left, the bytes needed)."""

    stored: int = 0
    failed: dict[CacheForm, str] = dataclasses.field(default_factory=dict)
    refused_objects: dict[CacheForm, int] = dataclasses.field(default_factory=dict)
    out_of_room: dict[CacheForm, RoomLeft] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class _Refusal:
    """Why the tier refused a batch, as a string, and what it said of its room: kept, not the exception (whose
    traceback would keep the tier's frames and their read transactions alive, `RoomLeft`)."""

    why: str
    left: RoomLeft | None
    kind: str  # the error's type and the limit it names: what the write-back's log tells apart (`RefusalLog`)

    @classmethod
    def of(cls, exc: Exception) -> _Refusal:
        left = exc.left if isinstance(exc, OutOfRoom) else None
        kind = type(exc).__name__ if left is None else f"{type(exc).__name__}/{left.limit}"
        return cls(f"{type(exc).__name__}: {exc}", left, kind)


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
