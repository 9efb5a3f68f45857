"""The manager's write-back: sealed pool objects persisted to the store by one background thread, bounded.

Fair across forms: a round's batches of every form go to the store together (one sync and one commit), and
where the store refuses that, each form's batch alone (`CacheManager.persist_batch`); a form the store refuses
(its quota, the budget, a disk error) is set aside for the rest of the pass and named in `blocked` with the
store's reason, so it holds back no other form. What waits (`backlog`), what is blocked and how many passes failed
are exported; `flush` and the shutdown drain read them to say what is not on disk and why.

A durable offload does not wait for a pass: `persist_first` stores the objects it names ahead of the
backlog, between two of the pass's batches, and says which forms the store refused them. Nor, mostly, for a
batch of the backlog: while durable offloads keep coming, the pass's next batch waits for them to pause
(`_yield_to_durable`), up to a bound, so a steady stream of them slows the backlog but never stops it.

A full store is not asked again and again within a pass: a refusal for want of room says the room left and the
bytes the batch needed (`OutOfRoom`), so the smaller batches that follow a refusal start at what the room takes,
none when it takes not one object. (Every pass still offers each form's batch once: a store below a cluster tier
hands even a refused batch down to the cluster, `kvtier.cluster.chain`, so every object must be offered.)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.core.forms import CacheForm
from kvtier.core.not_durable import NotDurableCause, NotDurableCount
from kvtier.core.tier import ObjectKey
from kvtier.daemon.runtime import Runtime

if TYPE_CHECKING:  # the pools' modules (and torch) load on the pool thread, behind serving
    from kvtier.gpu.writeback import PersistOutcome

log = logging.getLogger(__name__)
PERSIST_BATCH = 32
# A refused form's small batches that go in per pass. Without a bound, a pass went on while the cleaner made room
# a few objects at a time, each batch a durable write with its syncs, and every durable offload waiting for that
# pass waited with it (bench/verifier_offloads.py measures those waits); what is left waits for the next pass.
TRICKLE_BATCHES = 4
# An engine waits for its durable offload; nobody waits for a batch of the backlog, but a batch under way when the
# next durable offload comes holds that offload for a whole write (its syncs and its commit). So while durable
# offloads keep coming (one was served less than DURABLE_QUIET_S ago, longer than an engine takes between the answer
# to one offload and its next), the pass's next batch waits for them to pause, but never longer than DEFER_MAX_S:
# then it goes, and the stream of offloads waits for one batch. A flush, a sealer held back by the queue's depth or
# the shutdown waiting for the write-back ends the wait at once. (`bench/verifier_offloads.py` times the offloads
# while the cleaner makes room for the backlog.)
DURABLE_QUIET_S = 0.02
DEFER_MAX_S = 2.0


@dataclasses.dataclass(eq=False)
class _First:
    """A durable offload's objects, to be stored ahead of the backlog; `refused` is set once they were tried."""

    rt: Runtime
    keys: Sequence[ObjectKey]
    refused: dict[CacheForm, str] | None = None


class Persister:
    """Writes sealed pool objects to the store in the background (the manager's write-back), bounded.

    A *pass* persists everything sealed before it began. `sealed(n)` counts objects waiting for a
    pass and blocks the sealer while more than `depth` wait (back-pressure); `wait_pass()` returns
    once a pass that began after the call has finished (flush); `persist_first()` once the objects it
    names were tried, ahead of the rest (a durable offload).
    """

    def __init__(
        self,
        runtimes: list[Runtime],
        depth: int,
        quiet_s: float = DURABLE_QUIET_S,
        defer_max_s: float = DEFER_MAX_S,
    ) -> None:
        self.runtimes = runtimes
        self.depth = depth
        self.quiet_s, self.defer_max_s = quiet_s, defer_max_s
        self._cond = threading.Condition()
        self._waiting = 0  # sealed objects not yet covered by a started pass
        self._requested = 0
        self._completed = 0
        self.persisted = 0
        self.failed_passes = 0
        # (profile, form) -> why the store refused it: in the last pass, or a durable offload's objects since
        self.blocked: dict[tuple[str, str], str] = {}
        self._first: collections.deque[_First] = collections.deque()
        self._first_served = float("-inf")  # when the last durable offload's objects were tried (monotonic)
        # callers waiting for the write-back itself now (a flush, a sealer over the depth): the pass does not wait
        # for durable offloads to pause
        self._held = 0
        self._deferring_since: float | None = None  # when the pass's next batch began to wait for them
        self.deferred_s = 0.0  # how long the write-back's batches waited for durable offloads to pause, in all
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvtier-persist", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Sealed objects not yet in the store (all profiles and forms): the write-back queue."""
        return sum(n for per_form in self.backlog().values() for n in per_form.values())

    def backlog(self) -> dict[str, dict[str, int]]:
        """Per profile and form, sealed objects not yet in the store."""
        return {rt.name: {f.value: n for f, n in rt.manager.write_back_backlog().items() if n} for rt in self.runtimes}

    def reasons(self) -> list[str]:
        """Why objects wait: one line per blocked (profile, form)."""
        return [f"{profile}/{form}: {why}" for (profile, form), why in sorted(self.blocked.items())]

    def stuck(self) -> dict[str, dict[str, int]]:
        """Per profile and blocked form, the sealed objects the store refused last pass (they wait for room)."""
        backlog = self.backlog()
        out: dict[str, dict[str, int]] = {}
        for profile, form in sorted(self.blocked):
            per_form = backlog.get(profile, {})
            out.setdefault(profile, {})[form] = sum(per_form.values()) if form == "*" else per_form.get(form, 0)
        return out

    def why_waiting(self) -> list[NotDurableCount]:
        """The write-back queue by typed cause: each blocked (profile, form) with its stuck objects, then
        whatever waits only for the next pass."""
        out = [
            NotDurableCount(NotDurableCause.STORE_REFUSED, n, f"{profile}/{form}: {self.blocked[(profile, form)]}")
            for profile, per_form in self.stuck().items()
            for form, n in per_form.items()
        ]
        rest = self.queued - sum(c.objects for c in out)
        if rest > 0:
            out.append(NotDurableCount(NotDurableCause.WRITE_BACK_PENDING, rest, "sealed after the last pass began"))
        return out

    def sealed(self, n: int, timeout_s: float) -> None:
        """Note n newly sealed objects; wait (up to timeout_s) while the queue is over its depth."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._waiting += n
            self._requested += 1
            self._cond.notify_all()
            self._held += 1
            try:
                while self._waiting > self.depth and not self._stop:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        log.warning(
                            "persist queue over its depth (%d > %d) for %.0fs", self._waiting, self.depth, timeout_s
                        )
                        return
                    self._cond.wait(remaining)
            finally:
                self._held -= 1

    def request(self) -> None:
        """Ask for a pass without waiting for it (a retry of blocked write-back)."""
        with self._cond:
            self._requested += 1
            self._cond.notify_all()

    def wait_pass(self, timeout_s: float) -> tuple[bool, int]:
        """Block until a pass begun after this call completes; (done, objects persisted meanwhile)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            before = self.persisted
            self._requested += 1
            ticket = self._requested
            self._held += 1
            self._cond.notify_all()
            try:
                while self._completed < ticket:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._thread.is_alive():
                        return False, self.persisted - before
                    self._cond.wait(remaining)
                return True, self.persisted - before
            finally:
                self._held -= 1

    def persist_first(self, rt: Runtime, keys: Sequence[ObjectKey], timeout_s: float) -> dict[CacheForm, str] | None:
        """Store the objects of `keys` that are sealed and not in the store yet, ahead of the backlog (a durable
        offload waits for its own objects, not for a pass and whatever else it writes). Returns, once they were
        tried, the forms the store refused them and why (some may have gone in: see `_trickle`); None when they
        were not tried within `timeout_s` (a batch in progress took longer) or the thread is gone."""
        deadline = time.monotonic() + timeout_s
        first = _First(rt, keys)
        with self._cond:
            self._first.append(first)
            self._cond.notify_all()
            while first.refused is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    if first in self._first:
                        self._first.remove(first)
                    return None
                self._cond.wait(remaining)
            return first.refused

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._first and self._completed >= self._requested and not self._stop:
                    self._cond.wait()
                if self._stop and not self._first and self._completed >= self._requested:
                    return
                covering = self._requested if self._completed < self._requested else None
                if covering is not None:
                    self._waiting = 0
                    self._cond.notify_all()
            self._serve_first()
            if covering is not None:
                self._pass(covering)

    def _serve_first(self) -> None:
        """Store the objects durable offloads wait for, request by request, all forms in one batch or, refused by
        the budget, what its room takes (`CacheManager.persist_batch`); refused otherwise, each form alone and then
        in ever smaller batches (`_trickle`)."""
        while True:
            with self._cond:
                if not self._first:
                    return
                first = self._first.popleft()
            try:
                _, refused = self._store(first.rt, None, only=first.keys)
            except Exception as exc:  # a bug, not a refusal: the objects stay sealed for the next pass
                log.exception("persisting a durable offload's %s objects failed", first.rt.name)
                refused = dict.fromkeys((k.form for k in first.keys), f"{type(exc).__name__}: {exc}")
            with self._cond:
                first.refused = refused
                self._first_served = time.monotonic()
                if refused:  # the daemon's health says so at once; the next pass finds it again, or not
                    self.blocked = self.blocked | {(first.rt.name, f.value): why for f, why in refused.items()}
                self._cond.notify_all()

    def _yield_to_durable(self, rt: Runtime) -> None:
        """Before a batch of `rt`'s backlog: serve the durable offloads waiting, and while they keep coming wait
        for them to pause, serving each as it comes, up to `defer_max_s` (DURABLE_QUIET_S states why). No wait
        for an empty backlog, or while a flush, a sealer over the depth or the shutdown waits for the write-back."""
        self._serve_first()
        start = time.monotonic()
        if start - self._first_served >= self.quiet_s or not any(rt.manager.write_back_backlog().values()):
            return
        while True:
            with self._cond:
                while not self._first:
                    now = time.monotonic()
                    left = min(self._first_served + self.quiet_s, start + self.defer_max_s) - now
                    if left <= 0 or self._stop or self._held:
                        if self._deferring_since is not None:
                            self.deferred_s += now - self._deferring_since
                            self._deferring_since = None
                        return
                    if self._deferring_since is None:
                        self._deferring_since = now
                        self._cond.notify_all()
                    self._cond.wait(left)
            self._serve_first()

    def _first_waits(self) -> bool:
        """Whether a durable offload waits for its objects (read without the lock: a hint between two batches)."""
        return bool(self._first)

    def _pass(self, covering: int) -> None:
        """Persist everything sealed (the pass that covers requests up to `covering`), durable offloads' objects
        served between its batches."""
        blocked: dict[tuple[str, str], str] = {}
        failed = False
        for rt in self.runtimes:
            skip: set[CacheForm] = set()
            try:
                while True:  # small batches: the manager pins a batch while storing it, the rest stays evictable
                    self._yield_to_durable(rt)
                    out, refused = self._store(rt, PERSIST_BATCH, skip=skip)
                    skip.update(out.failed)
                    blocked.update({(rt.name, form.value): why for form, why in refused.items()})
                    if not out.stored:
                        break
            except Exception as exc:  # a bug, not a refusal: objects stay sealed and are retried next pass
                log.exception("persisting %s objects to the store failed", rt.name)
                blocked[(rt.name, "*")] = f"{type(exc).__name__}: {exc}"
                failed = True
        with self._cond:
            if blocked or failed:
                self.failed_passes += 1
            self.blocked = blocked
            self._completed = covering
            self._cond.notify_all()

    def _store(
        self,
        rt: Runtime,
        limit: int | None,
        *,
        skip: set[CacheForm] | None = None,
        only: Sequence[ObjectKey] | None = None,
    ) -> tuple[PersistOutcome, dict[CacheForm, str]]:
        """One batch of each form (`CacheManager.persist_batch`), each form the store refused retried in ever
        smaller batches (`_trickle`): the batch's outcome, and the forms still refused after that, and why."""
        out = rt.manager.persist_batch(
            limit, skip=skip or (), only=only, until=self._first_waits if only is None else None
        )
        self._count(out.stored)
        refused: dict[CacheForm, str] = {}
        for form, why in out.failed.items():
            first = _fits(out, form)
            if first is None:
                first = min(out.refused_objects[form], PERSIST_BATCH) // 2
            if (still := self._trickle(rt, form, why, first, only)) is not None:
                refused[form] = still
        return out, refused

    def _count(self, stored: int) -> None:
        with self._cond:
            self.persisted += stored

    def _trickle(
        self, rt: Runtime, form: CacheForm, refused: str, first: int, only: Sequence[ObjectKey] | None = None
    ) -> str | None:
        """A form's batch was refused (`refused`: why; a batch is all or nothing): store it (of `only`, where given)
        in smaller batches, from `first` objects, so a form with room for a few objects (the cleaner made some)
        still gets them in, at most TRICKLE_BATCHES of them this call. Why the rest waits (refused even one at a
        time, or the share taken), or None when nothing of the form is left. A pass's trickle lets durable
        offloads' objects go first between its batches, and waits for them to pause (`_yield_to_durable`).
        `first` is what the store said its room takes (`RoomLeft.fits`), else half the refused batch; a refused
        try halves it, or cuts it to what that refusal said fits. Room for none: no try, as every try of a full
        store costs the daemon an admission while the engines' loads and offloads wait for its GIL."""
        others = set(CacheForm) - {form}
        n = min(first, PERSIST_BATCH)
        stored_batches = 0
        while n > 0:
            if only is None:
                self._yield_to_durable(rt)
            out = rt.manager.persist_batch(n, skip=others, only=only, until=self._first_waits if only is None else None)
            self._count(out.stored)
            why = out.failed.get(form)
            if why is None and not out.stored:
                return None  # nothing of the form left
            if why is not None:
                fits = _fits(out, form)
                refused, n = why, n // 2 if fits is None else min(n // 2, fits)
                continue
            stored_batches += 1
            if stored_batches == TRICKLE_BATCHES:
                # blocked only while something of it still waits: a stale entry would keep the daemon's health
                # degraded, and nothing retries a form with nothing waiting
                return refused if rt.manager.write_back_backlog().get(form) else None
        return refused

    def stop(self, timeout_s: float) -> bool:
        """Finish the outstanding passes and end the thread; False if it did not end in time."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _fits(out: PersistOutcome, form: CacheForm) -> int | None:
    """How many of the form's refused batch the store's room would take (`RoomLeft.fits`); None: not said."""
    left = out.out_of_room.get(form)
    return None if left is None else left.fits(out.refused_objects[form])
