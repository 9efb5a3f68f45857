"""The persister's policy: a write-back pass is bounded, and a durable offload's objects go ahead of the backlog.

A form whose full batch the store refuses is stored in ever smaller batches, but at most TRICKLE_BATCHES of them a
pass: a pass that went on for as long as room kept appearing held up whatever waited for it. And a durable offload
does not wait for a pass: after the cleaner made room, a pass wrote the backlog that had piled up while the store was
full, and every durable offload waited for all of it (bench/verifier_offloads.py timed those waits);
`Persister.persist_first` stores the offload's own objects between two of the pass's batches. While such offloads
keep coming, the pass's next batch waits for them to pause, up to a bound, or until a flush or a sealer over the
queue's depth waits for the write-back.

The managers here are stand-ins for the part the persister reads: a store that takes batches of at most ROOM objects
(the room the cleaner made since the last), which a real cleaner gives only by timing; and a backlog whose batches
the test holds open, so the order is observed, not timed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.daemon.persister import PERSIST_BATCH, TRICKLE_BATCHES, Persister
from kvtier.gpu.writeback import PersistOutcome

ROOM = 4  # objects a batch may hold: the room made since the last batch
BACKLOG = 200


class _TrickleStore:
    """persist_batch as the manager answers it over a store with room for ROOM objects a batch."""

    def __init__(self, backlog: int) -> None:
        self.left = backlog
        self.batches: list[int] = []  # the sizes asked for, in order

    def persist_batch(
        self,
        limit: int | None = None,
        *,
        skip: frozenset[CacheForm] = frozenset(),
        only: object = None,
        until: Callable[[], bool] | None = None,
    ) -> PersistOutcome:
        if CacheForm.SWA in skip or not self.left:
            return PersistOutcome()
        n = min(limit or self.left, self.left)
        self.batches.append(n)
        if n > ROOM:
            return PersistOutcome(
                failed={CacheForm.SWA: "StoreFull: over the budget"}, refused_objects={CacheForm.SWA: n}
            )
        self.left -= n
        return PersistOutcome(stored=n)

    def write_back_backlog(self) -> dict[CacheForm, int]:
        return {CacheForm.SWA: self.left}


TIMEOUT_S = 30.0


def _keys(n: int, form: CacheForm) -> list[ObjectKey]:
    return [ObjectKey(b"n" * 16, bytes([i]) * 16, form.value, form) for i in range(n)]


class _HeldBacklog:
    """A backlog of `backlog` objects; each backlog batch waits until the test lets it go (`go`), and a batch of
    named objects (`only`) is stored at once, or refused when its form is in `refuse`."""

    def __init__(self, backlog: int, refuse: frozenset[CacheForm] = frozenset()) -> None:
        self.left = backlog
        self.refuse = refuse
        self.calls: list[str] = []  # "backlog" or "first:<n>", in order
        self.told_to_end: list[bool] = []  # per backlog batch: whether `until` said to end the call after it
        self.entered = threading.Semaphore(0)
        self.go = threading.Semaphore(0)

    def persist_batch(
        self,
        limit: int | None = None,
        *,
        skip: frozenset[CacheForm] = frozenset(),
        only: Sequence[ObjectKey] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> PersistOutcome:
        if only is not None:
            self.calls.append(f"first:{len(only)}")
            refused = {k.form for k in only} & self.refuse
            if refused:
                held = {f: min(limit or len(only), sum(k.form is f for k in only)) for f in refused}
                return PersistOutcome(failed=dict.fromkeys(refused, "StoreFull: over the budget"), refused_objects=held)
            return PersistOutcome(stored=len(only))
        if not self.left:
            return PersistOutcome()
        self.calls.append("backlog")
        self.entered.release()
        assert self.go.acquire(timeout=TIMEOUT_S)
        self.told_to_end.append(until is not None and until())  # asked as the real manager asks, between batches
        n = min(limit or self.left, self.left)
        self.left -= n
        return PersistOutcome(stored=n)

    def write_back_backlog(self) -> dict[CacheForm, int]:
        return {CacheForm.SWA: self.left}


def _queued(persister: Persister) -> None:
    """Until the persister holds a durable offload's request (it is queued under the persister's lock)."""
    with persister._cond:
        assert persister._cond.wait_for(lambda: bool(persister._first), TIMEOUT_S)


class _Runtime:
    def __init__(self, manager: _TrickleStore | _HeldBacklog) -> None:
        self.name = "ref-tiny"
        self.manager = manager


def test_a_pass_stores_a_bounded_number_of_small_batches_then_names_the_form_blocked() -> None:
    store = _TrickleStore(BACKLOG)
    rt = _Runtime(store)
    persister = Persister([rt], depth=1024)  # type: ignore[list-item]
    try:
        done, persisted = persister.wait_pass(30.0)
        assert done
        # 32 and 16 and 8 refused, then TRICKLE_BATCHES batches of 4 stored: not the whole backlog in one pass
        assert persisted == TRICKLE_BATCHES * ROOM, store.batches
        assert store.batches[0] == PERSIST_BATCH and max(store.batches[-TRICKLE_BATCHES:]) == ROOM
        assert persister.blocked == {("ref-tiny", "swa"): "StoreFull: over the budget"}
        assert persister.queued == BACKLOG - persisted
        # the next pass goes on from there
        done, more = persister.wait_pass(30.0)
        assert done and more == TRICKLE_BATCHES * ROOM
    finally:
        persister.stop(10.0)


def test_a_form_whose_last_objects_the_bound_took_is_not_named_blocked() -> None:
    rt = _Runtime(_TrickleStore(TRICKLE_BATCHES * ROOM))  # the pass's small batches take all of it
    persister = Persister([rt], depth=1024)  # type: ignore[list-item]
    try:
        done, persisted = persister.wait_pass(30.0)
        assert done and persisted == TRICKLE_BATCHES * ROOM and persister.queued == 0
        assert persister.blocked == {}  # nothing waits: the daemon's health must not say write-back is blocked
    finally:
        persister.stop(10.0)


@contextlib.contextmanager
def _serving(manager: _HeldBacklog, depth: int = 1 << 20, **timing: float) -> Iterator[tuple[_Runtime, Persister]]:
    """A persister over `manager`'s backlog; on the way out every held batch is let go and the persister stopped."""
    rt = _Runtime(manager)
    persister = Persister([rt], depth=depth, **timing)  # type: ignore[list-item]
    try:
        yield rt, persister
    finally:
        for _ in range(8):
            manager.go.release()
        persister.stop(10.0)


def test_a_durable_offloads_objects_go_between_two_batches_of_the_backlog() -> None:
    manager = _HeldBacklog(backlog=4 * PERSIST_BATCH)
    with _serving(manager) as (rt, persister):
        persister.request()  # a pass over the backlog begins
        assert manager.entered.acquire(timeout=TIMEOUT_S)  # its first batch is being stored
        got: list[dict[CacheForm, str] | None] = []
        keys = _keys(10, CacheForm.SWA)
        offload = threading.Thread(target=lambda: got.append(persister.persist_first(rt, keys, TIMEOUT_S)))  # type: ignore[arg-type]
        offload.start()
        _queued(persister)
        manager.go.release()  # the first batch ends; the offload's objects are next
        assert manager.entered.acquire(timeout=TIMEOUT_S)  # the pass's second batch is being stored ...
        offload.join(TIMEOUT_S)
        assert not offload.is_alive() and got == [{}]  # ... and the offload already has its answer
        assert manager.calls == ["backlog", "first:10", "backlog"]
        # the first batch was told to end there: a manager's call takes several batches, and the offload waits
        # for one of them, not for the call
        assert manager.told_to_end == [True]
        for _ in range(3):
            manager.go.release()
        done, _ = persister.wait_pass(TIMEOUT_S)
        assert done and manager.left == 0


def _after_a_durable_offload(rt: _Runtime, persister: Persister) -> None:
    """A durable offload's objects stored, then a pass over the backlog asked for."""
    assert persister.persist_first(rt, _keys(10, CacheForm.SWA), TIMEOUT_S) == {}  # type: ignore[arg-type]
    persister.request()


def _deferring(persister: Persister) -> None:
    """Until the pass's next batch waits for durable offloads to pause (set under the persister's lock)."""
    with persister._cond:
        assert persister._cond.wait_for(lambda: persister._deferring_since is not None, TIMEOUT_S)


LONG = {"quiet_s": 4 * TIMEOUT_S, "defer_max_s": 4 * TIMEOUT_S}  # offloads "keep coming" for the whole test


def test_a_stream_of_durable_offloads_meets_no_backlog_batch_until_a_flush() -> None:
    manager = _HeldBacklog(backlog=2 * PERSIST_BATCH)
    with _serving(manager, **LONG) as (rt, persister):
        _after_a_durable_offload(rt, persister)
        _deferring(persister)
        assert manager.calls == ["first:10"]  # no batch of the backlog began: the next offload would wait for it
        assert persister.persist_first(rt, _keys(10, CacheForm.SWA), TIMEOUT_S) == {}  # type: ignore[arg-type]
        assert manager.calls == ["first:10", "first:10"]
        flushed: list[tuple[bool, int]] = []
        flush = threading.Thread(target=lambda: flushed.append(persister.wait_pass(TIMEOUT_S)))
        flush.start()
        for _ in range(2):  # the flush ends the wait: the backlog's two batches go
            assert manager.entered.acquire(timeout=TIMEOUT_S)
            manager.go.release()
        flush.join(TIMEOUT_S)
        assert flushed == [(True, 2 * PERSIST_BATCH)] and manager.left == 0
        assert persister.deferred_s > 0


def test_a_sealer_held_back_by_the_depth_ends_the_wait() -> None:
    manager = _HeldBacklog(backlog=PERSIST_BATCH)
    with _serving(manager, depth=4, **LONG) as (rt, persister):
        _after_a_durable_offload(rt, persister)
        _deferring(persister)
        # an offload that is not durable seals more than the queue's depth: it waits for the write-back, so the
        # write-back no longer waits for durable offloads
        sealer = threading.Thread(target=persister.sealed, args=(10, TIMEOUT_S))
        sealer.start()
        assert manager.entered.acquire(timeout=TIMEOUT_S)
        assert manager.calls == ["first:10", "backlog"]
        manager.go.release()
        sealer.join(TIMEOUT_S)  # the next pass begins and takes its objects in
        assert not sealer.is_alive()


def test_a_backlog_batch_waits_for_durable_offloads_at_most_the_bound() -> None:
    manager = _HeldBacklog(backlog=PERSIST_BATCH)
    with _serving(manager, quiet_s=4 * TIMEOUT_S, defer_max_s=0.05) as (rt, persister):
        _after_a_durable_offload(rt, persister)
        # offloads count as still coming for far longer than the test, yet the batch goes once the bound is up
        assert manager.entered.acquire(timeout=TIMEOUT_S)
        assert manager.calls == ["first:10", "backlog"] and persister.deferred_s > 0


def test_a_refused_form_is_answered_with_the_stores_reason_not_waited_for() -> None:
    manager = _HeldBacklog(backlog=0, refuse=frozenset({CacheForm.SWA}))
    rt = _Runtime(manager)
    persister = Persister([rt], depth=1 << 20)  # type: ignore[list-item]
    try:
        keys = _keys(4, CacheForm.SWA) + _keys(4, CacheForm.COMPRESSED)
        refused = persister.persist_first(rt, keys, TIMEOUT_S)  # type: ignore[arg-type]
        assert refused == {CacheForm.SWA: "StoreFull: over the budget"}
        assert persister.blocked == {("ref-tiny", "swa"): "StoreFull: over the budget"}  # health says so at once
        # the whole request once, then the refused form's 4 objects in batches of 2, then 1: never a batch as
        # large as the refused one, which would be the same objects refused again
        assert manager.calls == ["first:8"] * 3
    finally:
        persister.stop(10.0)
