"""The write-back (pool -> lower tier) of one CacheManager: sealed objects stored in batches, bounded.

A *round* takes a batch of each form, at most `WRITE_BACK_PIN_SHARE` of each group's pool, pinned while the tier
stores it, and offers every form's batch in one batch of the tier: one sync and one commit, which a durable offload
waits for. Where the tier refuses that, what it refused decides what follows (`WriteBack._store_together`). A call
takes rounds until its limit, or until its caller says to end (the daemon's write-back ends a call once a durable
offload waits, and serves it first). Every step under the manager's lock first checks that the topology has not
moved since (a resize drops every slot, so the round's results would land nowhere).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.core.errors import OutOfRoom, RoomLeft, VersionError
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.gpu.context import ManagerContext
from kvtier.gpu.refusal_log import RefusalLog
from kvtier.gpu.states import BlockState

log = logging.getLogger(__name__)

# A write-back pins at most this share of each group's pool (at least one slot) while it stores them: the rest stays
# evictable, so a recovery meanwhile finds its victims. Unbounded, one batch of 32 pinned every unpersisted slot of a
# 16-slot pool, and a restore in that moment was recomputed (RECOMPUTE admission). Pools of thousands of slots never
# reach it.
WRITE_BACK_PIN_SHARE = 0.25

# one object of a round: slot, its generation, key, bytes, digest
_Work = tuple[int, int, ObjectKey, torch.Tensor, bytes]


class WriteBack:
    """The manager's write-back paths; runs under (and between holds of) the context's lock."""

    def __init__(self, context: ManagerContext) -> None:
        self._c = context
        self._refusals = RefusalLog()

    def backlog(self) -> np.ndarray:
        """Sealed objects of the live namespace not yet in the lower tier, per group."""
        t = self._c.table
        return np.bincount(t.s_group[self._unpersisted()], minlength=t.n_groups)

    def _unpersisted(self) -> np.ndarray:
        """A mask of the slots sealed in the live namespace whose objects the lower tier lacks. Caller holds the
        lock."""
        c = self._c
        t = c.table
        return (t.s_state == BlockState.SEALED) & ~t.s_recoverable & (t.s_ns == c.ns_id)

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
        refuses (its quota, say) does not hold back the others, or, refused by the budget, what its room takes
        (`_store_together`). A batch pins at most `WRITE_BACK_PIN_SHARE` of each group's pool, and the call takes
        batches until done, or until `until()` says to end between two."""
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
        leave `left`, and so does a form only part of which the budget's room took. Where each form is stored
        alone, once `until()` says so the forms not stored yet are left for the next call, untried. False when
        nothing was taken, or the topology moved (that round then counts for nothing, as its slots are gone)."""
        c = self._c
        with c.lock:
            t = c.table
            epoch = c.topology_epoch
            todo = self._unpersisted()
            if only is not None:
                todo &= self._holding(only, len(todo))
            batches: dict[CacheForm, list[_Work]] = {}
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
        together = self._store_together(batches) if len(batches) > 1 else _ALONE
        for form, work in batches.items():
            if together is _ALONE:
                if done and until is not None and until():  # each alone is a sync and a commit that one waits for
                    done.extend((slot, gen, False) for slot, gen, *_ in work)
                    continue
                try:
                    self._c.tier_below().store_many([(key, view, digest) for _, _, key, view, digest in work])
                    took, refusal = frozenset(slot for slot, *_ in work), None
                except VersionError as exc:  # a rollout retired the namespace since the batch was taken: stale now
                    log.info("write-back of %d %s objects skipped: %s", len(work), form.value, exc)
                    del left[form]
                    done.extend((slot, gen, False) for slot, gen, *_ in work)
                    continue
                except Exception as exc:
                    took, refusal = frozenset(), _Refusal.of(exc)
            else:
                took, refusal = together.took, together.refusal
            n_took = sum(slot in took for slot, *_ in work)
            if n_took:
                self._refusals.stored(form)
                stored += n_took
            if refusal is not None and n_took < len(work):
                self._refusals.refused(form, len(work) - n_took, refusal.kind, refusal.why)
                failed[form] = refusal.why
                refused_objects[form] = len(work) - n_took
                if refusal.left is not None:
                    out_of_room[form] = refusal.left
                del left[form]
            else:
                n = left[form]
                if not more[form] or (n is not None and n <= len(work)):
                    del left[form]  # done: everything it had, or its limit
                elif n is not None:
                    left[form] = n - len(work)
            done.extend((slot, gen, slot in took) for slot, gen, *_ in work)
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

    def _store_together(self, batches: dict[CacheForm, list[_Work]]) -> _Together:
        """Store every form's batch in one batch of the tier. All or nothing: where the tier refuses it, each form's
        batch is then stored alone (`_ALONE`), to learn which forms it refuses and why; but where the budget
        refused it, shared by every form, each alone would be refused the same way or take the room a batch at a
        time, each with its own sync and commit. So with no room left at all, every form is refused; with some
        room, the objects it takes go in as one batch (`_what_fits`), and the rest are refused."""
        items = [(key, view, digest) for work in batches.values() for _, _, key, view, digest in work]
        try:
            self._c.tier_below().store_many(items)
        except Exception as exc:
            refusal = _Refusal.of(exc)
            left = refusal.left
            if left is None or left.limit != "budget":
                log.debug(
                    "write-back of %d forms in one batch refused (%s): storing each form alone", len(batches), exc
                )
                return _ALONE
            if left.exhausted or left.room is None or not left.needed:
                return _Together(frozenset(), refusal)
            return self._what_fits(batches, refusal, left.room, left.needed)
        return _Together(frozenset(slot for work in batches.values() for slot, *_ in work), None)

    def _what_fits(self, batches: dict[CacheForm, list[_Work]], refusal: _Refusal, room: int, needed: int) -> _Together:
        """Of the forms' batches the budget refused, store in one batch what its room takes. An object counts its
        payload and an equal share of what the batch needed beyond the payloads (the tier's record headers; where
        it needed less, a compressed form's, each its share by size); the forms take turns, each in its batch's
        order, so that no form gets all the room. The rest is refused, with the room left after. Refused again (a
        quota, or the room gone meanwhile): each form alone."""
        sizes = {slot: view.numel() for work in batches.values() for slot, _, _, view, _ in work}
        payloads = sum(sizes.values())
        if needed >= payloads:
            extra = (needed - payloads) / len(sizes)
            cost = {slot: n + extra for slot, n in sizes.items()}
        else:
            cost = {slot: n * needed / payloads for slot, n in sizes.items()}
        picked: list[_Work] = []
        used = 0.0
        for turn in itertools.zip_longest(*batches.values()):
            for w in turn:
                if w is not None and used + cost[w[0]] <= room:
                    picked.append(w)
                    used += cost[w[0]]
        if not picked:
            return _Together(frozenset(), refusal)
        try:
            self._c.tier_below().store_many([(key, view, digest) for _, _, key, view, digest in picked])
        except Exception as exc:
            log.debug("write-back of what the room takes (%d objects) refused (%s): each form alone", len(picked), exc)
            return _ALONE
        rest = RoomLeft("budget", max(0, room - int(used)), max(0, needed - int(used)))
        return _Together(frozenset(w[0] for w in picked), dataclasses.replace(refusal, left=rest))

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


@dataclasses.dataclass(frozen=True, slots=True)
class _Together:
    """What became of a round's forms offered together: the slots the tier took, and the refusal for the rest."""

    took: frozenset[int]
    refusal: _Refusal | None


_ALONE = _Together(frozenset(), None)  # refused for a reason each form may not share: store each form alone
