"""A recovery claims its first objects, hands them to the lower tier, and claims the rest when the tier asks for
them (`LowerTier.load_into`'s `more`): what is claimed later is settled like the rest whatever the tier does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvtier.core import Reason, Route
from kvtier.core.tier import every_request
from kvtier.gpu import StaleHandle
from kvtier.gpu import recovery as recovery_mod
from kvtier.testing import MemoryTier
from support.gpuworld import PROFILE, budgets, hashes_of, key, make, payload, prompt, state_blocks_for, write

BLOCKS = 6


class SplitTier:
    """A MemoryTier that records how many slots were RECOVERING when the load began and once `more` returned, and
    runs `during` (if set) before it asks for more: `calls_more=False` ignores `more`, `fail_after` raises once
    the later requests are claimed."""

    def __init__(self, inner: MemoryTier, *, calls_more: bool = True, fail_after: bool = False) -> None:
        self.inner, self.calls_more, self.fail_after = inner, calls_more, fail_after
        self.m = None
        self.during: Callable[[], None] | None = None
        self.seen: list[tuple[int, int, int]] = []  # (first requests, recovering at entry, recovering after more)

    def has(self, keys, digests):
        return self.inner.has(keys, digests)

    def store_many(self, items):
        self.inner.store_many(items)

    def load_into(self, requests, more=None):
        at_entry = self.m.counters().recovering
        if self.during is not None:
            self.during()
        later = list(more()) if more is not None and self.calls_more else []
        self.seen.append((len(requests), at_entry, self.m.counters().recovering))
        if self.fail_after:
            raise OSError("the disk went away")
        return self.inner.load_into([*requests, *later])


def _recovering_world(tier_kw: dict, monkeypatch):
    """Six blocks written, stored below and evicted from the pools; the first claim is a few of their objects."""
    monkeypatch.setattr(recovery_mod, "FIRST_CLAIM_BYTES", 4096)
    m, inner, _ = make(blocks=16)
    tier = SplitTier(inner, **tier_kw)
    tier.m = m
    m._c.lower = tier
    hs = hashes_of(m, prompt(3, BLOCKS))
    written = write(m, hs, range(BLOCKS), state_at=state_blocks_for(PROFILE, BLOCKS))
    assert m.persist() == written
    m.evict([key(m, h, g.name) for h in hs for g in PROFILE.groups])
    result = m.lookup(hs)
    pending = int((result.check_vector.routes == Route.RECOVER).sum())
    assert 4 < pending <= written
    return m, tier, hs, result, pending


def _restored(m, hs, result) -> int:
    n = 0
    for gi, g in enumerate(PROFILE.groups):
        for b in range(BLOCKS):
            if result.check_vector.routes[gi, b] == Route.REUSE:
                assert torch.equal(m.read(m.handle(result, g.name, b)), payload(PROFILE, g.name, hs[b], m.namespace))
                n += 1
    return n


def test_the_rest_is_claimed_while_the_tier_reads_the_first(monkeypatch) -> None:
    m, tier, hs, result, pending = _recovering_world({}, monkeypatch)
    m.recover(result)
    (first, at_entry, after_more), *again = tier.seen
    assert not again  # one load for the whole prefix
    assert 1 <= first < pending and at_entry == first  # only the first objects' slots were claimed at entry
    assert after_more == pending  # the rest were claimed when the tier asked for them
    assert _restored(m, hs, result) == pending  # every one loaded, bitwise
    m.release(result)
    assert m.invariant_violations() == [] and m.counters().recovering == 0


@pytest.mark.parametrize(("first_bytes", "first_objects"), [(1 << 30, 64), (4096, 2)])
def test_the_first_part_is_the_first_bytes_at_most_so_many_objects_and_a_small_batch_is_not_split(
    monkeypatch, first_bytes, first_objects
) -> None:
    m, tier, hs, result, pending = _recovering_world({}, monkeypatch)
    monkeypatch.setattr(recovery_mod, "FIRST_CLAIM_BYTES", first_bytes)
    monkeypatch.setattr(recovery_mod, "FIRST_CLAIM_OBJECTS", first_objects)
    m.recover(result)
    ((first, at_entry, after_more),) = tier.seen
    assert first == at_entry == (pending if first_bytes > 1 << 20 else first_objects) and after_more == pending
    assert _restored(m, hs, result) == pending


def test_a_tier_that_never_asks_for_more_still_gets_everything_loaded(monkeypatch) -> None:
    """The rest stays pending and the next round claims it: a tier ignoring `more` costs rounds, not objects."""
    m, tier, hs, result, pending = _recovering_world({"calls_more": False}, monkeypatch)
    m.recover(result)
    assert len(tier.seen) > 1 and sum(first for first, _, _ in tier.seen) == pending
    assert _restored(m, hs, result) == pending
    m.release(result)
    assert m.invariant_violations() == [] and m.counters().recovering == 0


def test_a_tier_that_fails_after_asking_for_more_settles_every_claimed_slot(monkeypatch) -> None:
    m, tier, _, result, pending = _recovering_world({"fail_after": True}, monkeypatch)
    m.recover(result)
    assert tier.seen[0][2] == pending  # the later objects were claimed before the failure
    counters = m.counters()
    assert counters.recovering == 0 and sum(f.recovers_failed for f in counters.forms.values()) == pending
    routes, reasons = result.check_vector.routes, result.check_vector.reasons
    assert (routes[:, :BLOCKS] != Route.REUSE).all() and (reasons == Reason.CORRUPT).sum() >= 1
    m.release(result)
    assert m.invariant_violations() == []


@pytest.mark.parametrize("moved", ["lease released", "pools resized"])
def test_nothing_is_claimed_later_once_the_lease_or_the_topology_moved_on(monkeypatch, moved) -> None:
    m, tier, _, result, _ = _recovering_world({}, monkeypatch)
    if moved == "lease released":
        tier.during = lambda: m.release(result)
    else:

        def during() -> None:
            with m.recompile_window():
                m.resize(budgets(PROFILE, 16))

        tier.during = during
    with pytest.raises(StaleHandle):
        m.recover(result)
    ((first, at_entry, after_more),) = tier.seen
    assert at_entry == first and after_more == (first if moved == "lease released" else 0)
    assert m.counters().recovering == 0
    assert m.invariant_violations() == []


def test_every_request_asks_for_more_at_once() -> None:
    asked = []
    assert every_request([1], None) == [1]
    assert every_request([1], lambda: asked.append(1) or [2, 3]) == [1, 2, 3] and asked == [1]
