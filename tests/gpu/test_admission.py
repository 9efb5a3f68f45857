"""Admission caps: recover queue -> RECOMPUTE admission, recovering-at-once cap as a queue, entry cap,
quotas rebalanced by load, eviction order (state forms first, LRU within a form)."""

from __future__ import annotations

import threading

import torch

from kvtier.core import Reason, Route
from kvtier.core.tier import every_request
from kvtier.gpu import AdmissionRefused
from kvtier.gpu.writeback import WRITE_BACK_PIN_SHARE
from support.gpuworld import PROFILE, hashes_of, key, make, payload, prompt, state_blocks_for, write


def _on_lower_only(n: int = 4, **adm):
    """A prefix written, persisted, then evicted from the pools: every object is RECOVER."""
    m, tier, _ = make(blocks=8, **adm)
    hs = hashes_of(m, prompt(21, n))
    write(m, hs, range(n), state_at=state_blocks_for(PROFILE, n))
    assert m.persist() > 0
    keys = [key(m, h, g.name) for h in hs for g in PROFILE.groups]
    m.evict(keys)
    return m, tier, hs


def test_recover_queue_cap_routes_the_excess_recompute_admission() -> None:
    # checkpoints at boundaries 2 and 4; everything only on the lower tier
    m, _, _ = make(blocks=8, max_recover_queue=10)
    hs = hashes_of(m, prompt(21, 4))
    write(m, hs, range(4), state_at=state_blocks_for(PROFILE, 2) | state_blocks_for(PROFILE, 4))
    assert m.persist() > 0
    m.evict([key(m, h, g.name) for h in hs for g in PROFILE.groups])
    full = m.lookup(hs)  # unlimited would be 4 x 3 history + 2 x 3 state = 18 recoveries
    cv = full.check_vector
    # 10 fit boundary 2 (6 history + 2 swa + 1 + 1 tail), not boundary 4
    assert cv.hit_blocks == 2
    assert int((cv.routes == Route.RECOVER).sum()) == 10
    assert cv.reason("c4", 2) is Reason.ADMISSION and cv.reason("c16", 3) is Reason.ADMISSION
    assert m.counters().recover_queue == 10
    # the queue is now full: a second lookup gets nothing to recover
    cv2 = m.lookup(hs).check_vector
    assert cv2.hit_blocks == 0 and cv2.reason("c4", 0) is Reason.ADMISSION
    assert m.counters().forms["compressed"].recompute["admission"] >= 4
    m.recover(full)
    assert full.check_vector.hit_blocks == 2 and m.counters().recover_queue == 0
    again = m.lookup(hs).check_vector  # blocks 0-1 now resident; 2-3 (8 recoveries) fit the emptied queue
    assert again.hit_blocks == 4 and again.route("c4", 1) is Route.REUSE and again.route("c4", 3) is Route.RECOVER


class GatedTier:
    """Wraps a tier; load_into blocks until released, and records how many loads overlapped."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.entered = threading.Semaphore(0)
        self.gate = threading.Semaphore(0)

    def has(self, keys, digests):
        return self.inner.has(keys, digests)

    def load_into(self, requests, more=None):
        requests = every_request(requests, more)
        with self.lock:
            self.active += len(requests)
            self.peak = max(self.peak, self.active)
        self.entered.release()
        self.gate.acquire()
        try:
            return self.inner.load_into(requests)
        finally:
            with self.lock:
                self.active -= len(requests)

    def store(self, *a):
        return self.inner.store(*a)

    def pin(self, *a):
        return self.inner.pin(*a)

    def remove(self, *a):
        return self.inner.remove(*a)


def test_recovering_cap_turns_a_burst_into_a_queue() -> None:
    m, tier, hs = _on_lower_only(max_recovering=2)
    gated = GatedTier(tier)
    m._c.lower = gated  # same manager, loads now pass through the gate
    results = [m.lookup(hs, owner=i) for i in range(2)]
    done = []
    threads = [threading.Thread(target=lambda r=r: done.append(m.recover(r, timeout_s=30))) for r in results]
    for t in threads:
        t.start()
    loads = 0
    while any(t.is_alive() for t in threads):
        if gated.entered.acquire(timeout=0.5):
            assert m.counters().recovering <= 2
            gated.gate.release()
            loads += 1
    for t in threads:
        t.join()
    assert gated.peak <= 2 and loads >= 6  # 4 blocks x 4 history + state, two at a time
    for r in done:
        assert r.check_vector.hit_blocks == 4
        for h in m.handles(r):
            assert torch.equal(m.read(h, copy=True), payload(PROFILE, h.group, hs[h.block], m.namespace))
    c = m.counters().forms
    assert c["compressed"].recovers_ok == 8 and c["compressed"].recovery_latency_s.count == 8
    m.release(*done)
    assert m.invariant_violations() == []


def test_entry_cap_and_quota_rebalancing() -> None:
    m, _, _ = make(blocks=16, lower=False, max_entries=40, rebalance_every=8, min_form_share=0.05)
    start = m.counters().quota_slots
    # only history is written: its forms' demand pulls quota away from the state forms
    for seed in range(6):
        write(m, hashes_of(m, prompt(100 + seed, 4)), range(4))
    after = m.counters()
    assert after.quota_slots["compressed"] > start["compressed"]
    assert after.quota_slots["tail"] < start["tail"]
    assert sum(after.used_slots.values()) <= 40
    assert m.invariant_violations() == []


def test_state_forms_are_evicted_before_history_lru_within_form() -> None:
    # reservations for a cap of 15 follow capacity: compressed 8, indexer 4, swa 1, tail 2
    m, _, _ = make(blocks=6, state_blocks=2, lower=False, max_entries=15, rebalance_every=10_000)
    assert m.counters().quota_slots == {"swa": 1, "compressed": 8, "indexer": 4, "tail": 2}
    old = hashes_of(m, prompt(31, 2))
    new = hashes_of(m, prompt(32, 2))
    write(m, old, range(2), state_at={0, 1})  # 12 objects; swa holds 2 (> 1), tail 4 (> 2)
    write(m, new, [0])  # 3 more: at the cap, nothing evicted yet
    assert m.counters().forms["swa"].evictions + m.counters().forms["tail"].evictions == 0
    write(m, new, [1])  # 3 more: 3 evictions, all from the state forms above their reservation
    c = m.counters().forms
    assert c["compressed"].evictions == c["indexer"].evictions == 0
    assert c["swa"].evictions + c["tail"].evictions == 3
    assert c["swa"].evictions == 1  # swa back at its reservation; the rest from tail
    cv_old = m.lookup(old).check_vector
    # every history object is still resident (servable; past the hit only because its state went)
    assert all(
        cv_old.reason(g, b) in (Reason.OK, Reason.BEYOND_HIT) for g in ("c4", "c4_index", "c16") for b in range(2)
    )
    # LRU within the tail form: the block-0 tail objects (written first) went first
    assert cv_old.reason("c4_tail", 0) is Reason.EVICTED or cv_old.reason("c16_tail", 0) is Reason.EVICTED
    assert m.invariant_violations() == []


def test_a_pool_full_of_leased_objects_refuses_with_a_typed_error() -> None:
    m, _, _ = make(blocks=2, lower=False)
    hs = hashes_of(m, prompt(41, 2))
    write(m, hs, range(2), state_at=state_blocks_for(PROFILE, 2))
    held = m.lookup(hs)
    assert held.check_vector.hit_blocks == 2
    try:
        write(m, hashes_of(m, prompt(42, 1)), [0])
    except AdmissionRefused as exc:
        assert exc.code == "admission"
    else:
        raise AssertionError("a full, leased pool admitted a new object")
    m.release(held)
    write(m, hashes_of(m, prompt(42, 1)), [0])


class _HeldWriteBack:
    """Wraps a tier; store_many (the persister's write-back) blocks until released, its objects pinned."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def store_many(self, items):
        self.entered.set()
        assert self.gate.wait(30), "the test never released the write-back"
        return self.inner.store_many(items)


def test_a_write_back_in_flight_leaves_room_for_a_recovery() -> None:
    # The persister pins each batch while storing it. In a small pool (8 slots a group here, the e2e fault
    # matrix's daemon has 16 swa slots) one batch of 32 pinned every unpersisted object, so a restore in that
    # moment found no victim and was recomputed (RECOMPUTE admission): a write-back must leave most of a pool
    # evictable.
    m, tier, hs = _on_lower_only(n=4)
    other = hashes_of(m, prompt(22, 8))
    write(m, other, range(8), state_at=state_blocks_for(PROFILE, 8))  # the pools full of unpersisted objects
    held = _HeldWriteBack(tier)
    m._c.lower = held
    writer = threading.Thread(target=m.persist_batch, kwargs={"limit": 32})
    writer.start()
    try:
        assert held.entered.wait(30)
        pinned = int((m._c.table.s_pins > 0).sum())
        assert 0 < pinned <= sum(max(1, int(p.n_slots * WRITE_BACK_PIN_SHARE)) for p in m._c.pools)
        r = m.recover(m.lookup(hs), timeout_s=5)
        assert r.check_vector.hit_blocks == 4, r.check_vector.counts()
        for h in m.handles(r):
            assert torch.equal(m.read(h, copy=True), payload(PROFILE, h.group, hs[h.block], m.namespace))
        m.release(r)
    finally:
        held.gate.set()
        writer.join()
    assert m.invariant_violations() == []
