"""A write-back pass is bounded while the cleaner makes room a few objects at a time.

A form whose full batch the store refuses is stored in ever smaller batches, but at most TRICKLE_BATCHES of them a
pass: a pass that went on for as long as room kept appearing held every durable offload waiting for it
(bench/verifier_offloads.py). The manager here is a stand-in for the one part the pass policy reads, a store that
takes batches of at most ROOM objects (the room the cleaner made since the last), which a real cleaner gives
only by timing.
"""

from __future__ import annotations

from kvtier.core.forms import CacheForm
from kvtier.daemon.persister import PERSIST_BATCH, TRICKLE_BATCHES, Persister
from kvtier.gpu.recovery import PersistOutcome

ROOM = 4  # objects a batch may hold: the room made since the last batch
BACKLOG = 200


class _TrickleStore:
    """persist_batch as the manager answers it over a store with room for ROOM objects a batch."""

    def __init__(self, backlog: int) -> None:
        self.left = backlog
        self.batches: list[int] = []  # the sizes asked for, in order

    def persist_batch(
        self, limit: int | None = None, *, skip: frozenset[CacheForm] = frozenset(), only: object = None
    ) -> PersistOutcome:
        if CacheForm.SWA in skip or not self.left:
            return PersistOutcome()
        n = min(limit or self.left, self.left)
        self.batches.append(n)
        if n > ROOM:
            return PersistOutcome(failed={CacheForm.SWA: "StoreFull: over the budget"})
        self.left -= n
        return PersistOutcome(stored=n)

    def write_back_backlog(self) -> dict[CacheForm, int]:
        return {CacheForm.SWA: self.left}


class _Runtime:
    def __init__(self, backlog: int) -> None:
        self.name = "ref-tiny"
        self.manager = _TrickleStore(backlog)


def test_a_pass_stores_a_bounded_number_of_small_batches_then_names_the_form_blocked() -> None:
    rt = _Runtime(BACKLOG)
    persister = Persister([rt], depth=1024)  # type: ignore[list-item]
    try:
        done, persisted = persister.wait_pass(30.0)
        assert done
        # 32 and 16 and 8 refused, then TRICKLE_BATCHES batches of 4 stored: not the whole backlog in one pass
        assert persisted == TRICKLE_BATCHES * ROOM, rt.manager.batches
        assert rt.manager.batches[0] == PERSIST_BATCH and max(rt.manager.batches[-TRICKLE_BATCHES:]) == ROOM
        assert persister.blocked == {("ref-tiny", "swa"): "StoreFull: over the budget"}
        assert persister.queued == BACKLOG - persisted
        # the next pass goes on from there
        done, more = persister.wait_pass(30.0)
        assert done and more == TRICKLE_BATCHES * ROOM
    finally:
        persister.stop(10.0)


def test_a_form_whose_last_objects_the_bound_took_is_not_named_blocked() -> None:
    rt = _Runtime(TRICKLE_BATCHES * ROOM)  # the pass's small batches take all of it
    persister = Persister([rt], depth=1024)  # type: ignore[list-item]
    try:
        done, persisted = persister.wait_pass(30.0)
        assert done and persisted == TRICKLE_BATCHES * ROOM and persister.queued == 0
        assert persister.blocked == {}  # nothing waits: the daemon's health must not say write-back is blocked
    finally:
        persister.stop(10.0)
