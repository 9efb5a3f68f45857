"""Over budget or quota: state forms and least recently used first, pinned entries last and only past the hard limit."""

from __future__ import annotations

import time

from kvtier.core import CacheForm, Reason
from kvtier.store import DiskStore, StoreConfig, StoreLimits
from kvtier.store.record import record_length
from kvtier.verifier import Verifier, VerifierSettings
from support.verifier_helpers import (
    DIGEST,
    VK,
    assert_consistent,
    entries,
    load,
    populate,
    start_verifier,
    stop,
    wait_for,
)

SIZE = 20_000
REC = record_length(SIZE)


def _specs(prefix: str, form: CacheForm, n: int) -> list:
    return [(VK, f"{prefix}{i}", form, SIZE) for i in range(n)]


def test_running_verifier_evicts_state_then_lru_history_then_pinned_only_past_the_hard_budget(tmp_path) -> None:
    root = str(tmp_path / "store")
    recs = populate(
        root,
        _specs("h", CacheForm.COMPRESSED, 16)
        + _specs("s", CacheForm.SWA, 4)
        + _specs("t", CacheForm.TAIL, 4)
        + _specs("p", CacheForm.INDEXER, 8),
    )
    hist, state, pinned = recs[:16], recs[16:24], recs[24:]
    recent = hist[7:]
    with DiskStore(root, StoreConfig(atime_flush_s=0.0), writer=True) as w:
        assert w.pin([r.key for r in pinned], 3600.0) == len(pinned)
        time.sleep(0.01)  # distinct clock reading for the accesses below (not synchronisation)
        load(w, recent)  # accessed after the rest: the least recently used history is hist[:7]
        w.flush_atimes()
        w.set_limits(20 * REC, {})  # 32 records stored: 15 must go to reach the low watermark (85%: 17 records)
    proc = start_verifier(root)
    try:

        def remaining() -> set | None:
            with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
                # usage first, keys after: each read is its own transaction, and keys read before an eviction
                # commit that brings usage under the watermark would still hold what it evicted
                used = s.stats()["record_bytes"]
                keys = set(entries(s))
            return keys if used <= 0.85 * 20 * REC else None

        keys = wait_for(remaining, 30.0, proc, "usage under the low watermark")
        assert not {r.key for r in state} & keys, "state forms go first"
        assert {r.key for r in recent} | {r.key for r in pinned} == keys, (
            "then the least recently used history, never pinned"
        )

        with DiskStore(root, writer=True) as w:
            w.set_limits(4 * REC, {})  # below what the pins hold: the hard budget wins over pins

        keys = wait_for(
            lambda: k if len(k := _keys(root)) <= 4 else None, 30.0, proc, "evicted down to the hard budget"
        )
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert keys == {r.key for r in pinned[4:]}, "only pinned records remain, the least recently used pins went first"
    assert_consistent(root)


def _keys(root: str) -> set:
    with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
        return set(entries(s))


def test_form_quota_evicts_only_that_form(tmp_path) -> None:
    root = str(tmp_path / "store")
    recs = populate(root, _specs("h", CacheForm.COMPRESSED, 6) + _specs("s", CacheForm.SWA, 10))
    with DiskStore(root) as s:
        v = Verifier(s, VerifierSettings(limits=StoreLimits(0, StoreConfig.quotas({CacheForm.SWA: 5 * REC}))))
        v.maintain()
        forms = [e.form for e in entries(s).values()]
        assert forms.count(CacheForm.COMPRESSED) == 6 and forms.count(CacheForm.SWA) == 4  # 85% of 5 records
        assert v.actions["evicted"] == 6
    assert_consistent(root)
    assert all(r.key in {k for k in _keys(root)} for r in recs[:6])


def test_evicted_keys_read_evicted_until_their_tombstones_expire(tmp_path) -> None:
    root = str(tmp_path / "store")
    recs = populate(root, _specs("s", CacheForm.SWA, 10))
    digests = [DIGEST] * len(recs)
    with DiskStore(root) as s:
        v = Verifier(s, VerifierSettings(limits=StoreLimits(0, StoreConfig.quotas({CacheForm.SWA: 5 * REC}))))
        v.maintain()
        answers = s.has([r.key for r in recs], digests)
        assert answers.count(Reason.EVICTED) == v.actions["evicted"] == 6 and answers.count(Reason.OK) == 4
        v.maintain()  # within the retention: the tombstones stay
        assert s.stats()["evicted_tombstones"] == 6 and "tombstones_pruned" not in v.actions
        expired = Verifier(s, v.settings.replace(tombstone_retention_s=-1.0))  # every tombstone is past it
        expired.maintain()
        assert expired.actions["tombstones_pruned"] == 6, dict(expired.actions)
        assert s.stats()["evicted_tombstones"] == 0
        assert sorted(s.has([r.key for r in recs], digests)) == sorted([Reason.OK] * 4 + [Reason.MISSING] * 6)
    assert_consistent(root)
