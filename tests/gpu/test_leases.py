"""Leases: StaleHandle after eviction, TTL expiry (counted), idempotent release, owners, protection."""

from __future__ import annotations

import pytest
import torch

from kvtier.core import Reason, Route
from kvtier.gpu import AdmissionRefused, StaleHandle
from support.gpuworld import PROFILE, hashes_of, key, make, payload, prompt, state_blocks_for, write


def _filled(blocks: int = 6, n: int = 4, **kw):
    m, tier, clock = make(blocks=blocks, **kw)
    hs = hashes_of(m, prompt(11, n))
    write(m, hs, range(n), state_at=state_blocks_for(PROFILE, n))
    return m, tier, clock, hs


def test_stale_handle_after_eviction() -> None:
    m, _, _, hs = _filled()
    result = m.lookup(hs, owner="a")
    handle = m.handle(result, "c4", 1)
    view = m.read(handle)
    assert torch.equal(view, payload(PROFILE, "c4", hs[1], m.namespace)) and m.valid(handle)
    assert m.evict([key(m, hs[1], "c4")]) == 1  # explicit eviction ignores leases, never pins
    assert not m.valid(handle)
    with pytest.raises(StaleHandle, match="evicted"):
        m.read(handle)
    # the slot is reused by another object: the old handle still never reads it
    other = hashes_of(m, prompt(12, 1))
    write(m, other, [0])
    with pytest.raises(StaleHandle):
        m.read(handle, copy=True)
    cv = m.lookup(hs).check_vector
    assert cv.hit_blocks == 0 or cv.hit_blocks <= 1


def test_ttl_expiry_is_counted_and_frees_protection() -> None:
    m, _, clock, hs = _filled(blocks=4, ttl=5.0)
    result = m.lookup(hs, owner="leaky")
    handle = m.handle(result, "c4", 0)
    # while leased, pressure cannot evict the hit: writing a new prefix fails for want of room
    fresh = hashes_of(m, prompt(13, 4))
    with pytest.raises(AdmissionRefused, match="pinned, leased or in flight"):
        write(m, fresh, range(4))
    clock.advance(5.0)
    with pytest.raises(StaleHandle, match="expired"):
        m.read(handle)
    assert m.counters().leases_expired == 1
    assert m.release(result) == 0  # already gone: release is idempotent
    write(m, fresh, range(4))  # the expired lease no longer protects anything
    assert m.invariant_violations() == []


def test_release_is_idempotent_and_owner_release_covers_writes() -> None:
    m, _, _, hs = _filled()
    r1 = m.lookup(hs, owner="client-1")
    r2 = m.lookup(hs, owner="client-1")
    w = m.begin_write(
        key(m, hashes_of(m, prompt(14, 1))[0], "c4"), layout_digest=m.layout_digest("c4"), owner="client-1"
    )
    assert w is not None
    assert m.release(r1) == 1 and m.release(r1) == 0 and m.release([r1]) == 0
    assert m.release_owner("client-1") == 2  # r2 and the open write
    with pytest.raises(StaleHandle):
        m.seal(w, written_bytes=w.nbytes)
    assert m.counters().live_leases == 0 and m.invariant_violations() == []
    assert not r2.leases.live


def test_write_handles_expire_too() -> None:
    m, _, clock, _ = _filled(ttl=2.0)
    h = hashes_of(m, prompt(15, 1))[0]
    w = m.begin_write(key(m, h, "c16"), layout_digest=m.layout_digest("c16"))
    assert w is not None
    clock.advance(3.0)
    m.lookup([h])  # any call sweeps expired leases and writes
    assert m.counters().writes_expired == 1
    with pytest.raises(StaleHandle):
        m.seal(w, written_bytes=w.nbytes)
    assert m.block_state("c16", w.slot).state.name == "FREE"


def test_pinned_objects_are_never_evicted() -> None:
    m, _, _, hs = _filled(blocks=4)
    assert m.pin([key(m, hs[0], "c4")]) == 1
    assert m.evict([key(m, hs[0], "c4")]) == 0
    fresh = hashes_of(m, prompt(16, 8))
    write(m, fresh, range(8))  # twice the pool's size through it: everything but the pin turns over
    assert m.counters().forms["compressed"].evictions >= 8
    r = m.lookup(hs[:1])
    assert r.check_vector.reason("c4", 0).name in ("OK", "BEYOND_HIT")  # still resident
    assert m.lookup(hs[1:2]).check_vector.reason("c4", 0).name == "MISSING"
    m.release(r)
    assert m.unpin([key(m, hs[0], "c4")]) == 1 and m.unpin([key(m, hs[0], "c4")]) == 0
    assert m.evict([key(m, hs[0], "c4")]) == 1


def test_recovery_keeps_rows_that_only_another_released_lease_kept_indexed() -> None:
    """A row with nothing resident stays indexed only while a lease holds it. Lease `a` keeps the rows
    of an evicted prefix; `b` looks them up (RECOVER) and `a` is released: b's recovery must re-hold
    the rows before letting go of the old hold, or the rows are unindexed (and may be reused by
    another hash) under b's feet."""
    m, _, _, hs = _filled(blocks=8)
    assert m.persist() > 0
    a = m.lookup(hs, owner="a")
    assert m.evict([key(m, h, g.name) for h in hs for g in PROFILE.groups]) > 0
    b = m.lookup(hs, owner="b")
    assert b.check_vector.hit_blocks == len(hs) and (b.check_vector.routes == Route.RECOVER).any()
    m.release(a)
    m.recover(b)
    assert b.check_vector.hit_blocks == len(hs) and not (b.check_vector.routes == Route.RECOVER).any()
    for blk, group, _form, route, _reason in b.check_vector.entries():
        if route is Route.REUSE:
            assert torch.equal(m.read(m.handle(b, group, blk)), payload(PROFILE, group, hs[blk], m.namespace))
    assert m.invariant_violations() == []


def test_recovery_after_a_version_bump_loads_nothing_of_the_old_namespace() -> None:
    m, _, _, hs = _filled(blocks=8)
    assert m.persist() > 0
    m.evict([key(m, h, g.name) for h in hs for g in PROFILE.groups])
    old = m.lookup(hs)
    assert (old.check_vector.routes == Route.RECOVER).any()
    m.set_version(PROFILE.version.bumped(indexer_version="ref-indexer/2"))
    m.recover(old)
    cv = old.check_vector
    assert not (cv.routes == Route.RECOVER).any() and cv.hit_blocks == 0
    assert Reason.STALE_VERSION in {r for *_, route, r in cv.entries() if route is Route.RECOMPUTE}
    assert m.counters().forms["compressed"].recovers_ok == 0
