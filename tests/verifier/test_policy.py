"""Eviction plans: state and LRU first, quarantined before anything, pins only past the hard limit."""

from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.store import StoreConfig, StoreLimits
from kvtier.verifier import Candidate, plan_eviction

NOW = 1_000_000.0
NS = b"n" * 16

cands = st.lists(
    st.tuples(
        st.sampled_from([CacheForm.COMPRESSED, CacheForm.INDEXER, CacheForm.SWA, CacheForm.TAIL]),
        st.integers(1, 8).map(lambda n: n * 4096),
        st.floats(0, 1000),
        st.booleans(),  # pinned
        st.booleans(),  # quarantined
    ),
    max_size=60,
)


def _make(rows) -> list[Candidate]:
    return [
        Candidate(
            ObjectKey(NS, xxhash.xxh3_128_digest(str(i).encode()), f.value, f),
            i,
            n,
            at,
            NOW + 60 if pin else 0.0,
            1,
            q,
            NOW - 1 if q else 0.0,
        )
        for i, (f, n, at, pin, q) in enumerate(rows)
    ]


@settings(max_examples=300, deadline=None)
@given(rows=cands, budget_frac=st.floats(0.05, 1.2), quota_frac=st.one_of(st.none(), st.floats(0.05, 1.2)))
def test_plan_properties(rows, budget_frac, quota_frac) -> None:
    cs = _make(rows)
    usage: dict[CacheForm, int] = {}
    for c in cs:
        usage[c.key.form] = usage.get(c.key.form, 0) + c.record_len
    total, swa = sum(usage.values()), usage.get(CacheForm.SWA, 0)
    budget = max(1, int(total * budget_frac))
    quota = max(1, int(swa * quota_frac)) if quota_frac is not None else 0
    limits = StoreLimits(budget, StoreConfig.quotas({CacheForm.SWA: quota} if quota else {}))
    victims = plan_eviction(cs, usage, limits, NOW)
    chosen = {id(v) for v in victims}
    kept = [c for c in cs if id(c) not in chosen]
    left = sum(c.record_len for c in kept)
    swa_left = sum(c.record_len for c in kept if c.key.form is CacheForm.SWA)

    def breakable(c: Candidate) -> bool:  # may go without breaking a pin
        return c.quarantined or not c.pinned(NOW)

    if total < 0.95 * budget and (not quota or swa < 0.95 * quota):
        assert victims == [], "nothing is over a high watermark"
    if total >= 0.95 * budget:
        assert left <= 0.85 * budget or not any(breakable(c) for c in kept), (
            "soft: every unpinned record before stopping short"
        )
    if total > budget:
        assert left <= budget or not kept, "hard: pins give way until the budget holds"
    if quota and swa >= 0.95 * quota:
        assert swa_left <= 0.85 * quota or not any(breakable(c) for c in kept if c.key.form is CacheForm.SWA)
    if quota and swa > quota:
        assert swa_left <= quota or not any(c.key.form is CacheForm.SWA for c in kept)
    for v in victims:
        if v.pinned(NOW) and not v.quarantined:
            form_forced = v.key.form is CacheForm.SWA and swa > quota > 0  # its form is over its own hard quota
            assert total > budget or form_forced, "a pin broken under the hard limit"
            rivals = [c for c in kept if breakable(c) and (c.key.form is v.key.form or not form_forced)]
            assert not rivals, "a pin broken before an unpinned record that would have served the same limit"
    ranks = [v.rank(NOW) for v in victims]
    assert ranks == sorted(ranks), "quarantined, then unpinned state, then unpinned history (LRU), then pinned"


def test_order_quarantined_state_history_pinned() -> None:
    rows = [
        (CacheForm.COMPRESSED, 4096, 1.0, False, False),  # old history
        (CacheForm.SWA, 4096, 900.0, False, False),  # recent state
        (CacheForm.COMPRESSED, 4096, 0.0, True, False),  # oldest, but pinned
        (CacheForm.INDEXER, 4096, 999.0, False, True),  # quarantined
        (CacheForm.COMPRESSED, 4096, 500.0, False, False),  # recent history
    ]
    cs = _make(rows)
    usage = {CacheForm.COMPRESSED: 3 * 4096, CacheForm.SWA: 4096, CacheForm.INDEXER: 4096}
    picks = plan_eviction(cs, usage, StoreLimits(3 * 4096), NOW)  # soft: down to 85% of 3 records
    assert [p.seq for p in picks] == [3, 1, 0]
    picks = plan_eviction(cs, usage, StoreLimits(4096), NOW)  # hard: at the budget after four, so the pin holds
    assert [p.seq for p in picks] == [3, 1, 0, 4]
    picks = plan_eviction(cs, usage, StoreLimits(2048), NOW)  # below one record: the pin gives way, last
    assert [p.seq for p in picks] == [3, 1, 0, 4, 2]
