"""Truthful `durable=True`: an offload is acknowledged durable only for objects the store has committed.

The objects an offload names include those it did not write itself: ones another connection had reserved
(and may never seal: killed mid-copy), ones already cached, ones refused a slot. Each is checked in the
store's index once the persister has tried to store them (ahead of its backlog); objects still being written
elsewhere are waited for, up to a bound;
whatever is not committed at the end is counted `not_durable`, with its typed cause, never acknowledged.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.not_durable import NotDurableCause as Cause
from kvtier.core.not_durable import NotDurableCount
from kvtier.core.tier import ObjectKey
from kvtier.daemon.persister import Persister
from kvtier.daemon.runtime import Runtime
from kvtier.gpu import BlockState
from kvtier.store import DiskStore

POLL_S = 0.05  # how often a durable offload re-checks objects another connection is still writing


@dataclasses.dataclass(frozen=True, slots=True)
class Durability:
    durable: int
    not_durable: int
    why: list[NotDurableCount]


def make_durable(
    store: DiskStore,
    persister: Persister,
    rt: Runtime,
    keys: Sequence[ObjectKey],
    refused: frozenset[int],
    wait_s: float,
) -> Durability:
    """Write back and check every named object (indices in `refused` got no slot); waits up to `wait_s`
    for objects other connections are still writing. The write-back of the named objects goes ahead of
    the backlog (`Persister.persist_first`); the verifier's decisions wait meanwhile (`DiskStore.durable_first`)."""
    with store.durable_first():
        manager = rt.manager
        digests = [manager.layout_digest(k.group) for k in keys]
        deadline = time.monotonic() + wait_s
        pause = threading.Event()
        todo: Sequence[ObjectKey] = keys
        while True:
            refused_now = persister.persist_first(rt, todo, max(0.0, deadline - time.monotonic()))
            answers = store.has(keys, digests)
            missing = [i for i, a in enumerate(answers) if a != Reason.OK]
            states = manager.residence([keys[i] for i in missing])
            why: collections.Counter[tuple[Cause, str]] = collections.Counter()
            waiting = False
            for i, state in zip(missing, states):
                cause, detail = _why(i, state, keys[i], refused, refused_now or {})
                why[(cause, detail)] += 1
                waiting = waiting or cause in _NOT_FINAL
            if not missing or not waiting or refused_now is None or time.monotonic() >= deadline:
                counts = [NotDurableCount(cause, n, detail) for (cause, detail), n in sorted(why.items())]
                return Durability(len(keys) - len(missing), len(missing), counts)
            todo = [keys[i] for i in missing]
            pause.wait(min(POLL_S, max(0.0, deadline - time.monotonic())))


_NOT_FINAL = (Cause.RESERVED_ELSEWHERE, Cause.WRITE_BACK_PENDING)  # may still change before the deadline


def _why(
    i: int,
    state: BlockState | None,
    key: ObjectKey,
    refused: frozenset[int],
    refused_now: dict[CacheForm, str],
) -> tuple[Cause, str]:
    """Why object i is not in the store (typed cause, and the detail for humans); `refused_now`: the forms
    whose write-back the store just refused, and why."""
    if state is BlockState.WRITING:
        return Cause.RESERVED_ELSEWHERE, "reserved by another connection and not sealed in time"
    if state in (BlockState.SEALED, BlockState.RECOVERING):
        blocked = refused_now.get(key.form)
        if blocked is not None:
            return Cause.STORE_REFUSED, f"the store refuses {key.form.value} objects ({blocked})"
        return Cause.WRITE_BACK_PENDING, "waiting for write-back at the deadline"
    if i in refused:
        return Cause.ADMISSION, "refused a pool slot (admission) and not in the store"
    return (
        Cause.ABANDONED,
        "not cached: another connection's reservation was abandoned, or it was evicted before the store commit",
    )
