"""Recovery claims and settles objects a batch at a time: the batch paths keep the one-object semantics."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.core import Route
from kvtier.gpu import AdmissionConfig
from kvtier.gpu.counters import Counters
from kvtier.gpu.slots import SlotSpace
from kvtier.gpu.states import BlockState
from support.gpuworld import PROFILE, budgets, hashes_of, key, make, payload, prompt, state_blocks_for, write


def test_a_hash_named_twice_in_one_lookup_is_loaded_once_and_reused_by_both_blocks() -> None:
    m, tier, _ = make(blocks=8)
    hs = hashes_of(m, prompt(31, 2))
    write(m, hs, range(2), state_at=state_blocks_for(PROFILE, 2))
    assert m.persist() > 0
    m.evict([key(m, h, g.name) for h in hs for g in PROFILE.groups])
    loads_before = tier.loads
    result = m.lookup([hs[0], hs[1], hs[0]])  # a client may send any list; the third block repeats the first
    cv = result.check_vector
    history = [g.name for g in PROFILE.groups if (cv.routes[PROFILE.groups.index(g), :3] == Route.RECOVER).all()]
    assert history, "the repeated block must be a RECOVER hit in some group"
    m.recover(result)
    for name in history:
        assert m.handle(result, name, 0).slot == m.handle(result, name, 2).slot
        view = m.read(m.handle(result, name, 2))
        assert torch.equal(view, payload(PROFILE, name, hs[0], m.namespace))
    # each distinct object was read from the lower tier once, and the table is consistent
    named = [hs[0], hs[1], hs[0]]
    reused = {(int(g), named[b]) for g, b in np.argwhere(result.check_vector.routes == Route.REUSE)}
    assert len(reused) < int((result.check_vector.routes == Route.REUSE).sum())  # the repeat was reused
    assert tier.loads - loads_before == len(reused)
    assert m.invariant_violations() == []
    m.release(result)
    assert m.invariant_violations() == [] and m.counters().recovering == 0


def _space(blocks: int, **adm: object) -> SlotSpace:
    return SlotSpace(
        PROFILE,
        budgets(PROFILE, blocks),
        torch.device("cpu"),
        AdmissionConfig(**adm),  # type: ignore[arg-type]
        Counters(tuple(g.form for g in PROFILE.groups)),
    )


def test_allocate_many_gives_what_allocate_gives_one_by_one() -> None:
    groups = np.array([0, 1, 0, 2, 1, 0, 3, 3], dtype=np.int64) % len(PROFILE.groups)
    for blocks, cap in ((6, 0), (2, 0), (6, 5)):  # room for all (0: no cap); a pool runs dry; the entry cap binds
        batch, single = _space(blocks, max_entries=cap), _space(blocks, max_entries=cap)
        got = batch.allocate_many(groups, 0)
        want = []
        for g in groups.tolist():
            try:
                want.append(single.allocate(g, 0))
            except Exception:
                want.append(-1)
        assert got.tolist() == want, (blocks, cap)
        assert batch.quotas.used.tolist() == single.quotas.used.tolist()
        assert batch.table.free == single.table.free
        assert (got < 0).any() == (blocks == 2 or cap == 5)


def test_allocate_many_evicts_what_allocate_evicts_one_by_one() -> None:
    """Full pools: the batch picks its victims at once, the same slots in the same order as one by one."""
    spaces = []
    for _ in range(2):
        m, _, clock = make(blocks=4)
        hs = hashes_of(m, prompt(5, 4))
        write(m, hs, range(4), state_at=state_blocks_for(PROFILE, 4))
        clock.advance(1.0)
        m.release(m.lookup([hs[2], hs[0]]))  # touched: blocks 1 and 3 are now the least recently used
        spaces.append(m._c.space)
    batch, single = spaces
    groups = np.array([1, 1, 2, 0, 1, 3, 0, 0], dtype=np.int64)  # history pools full, the state pool half
    free_before = {s for free in batch.table.free for s in free}
    got = batch.allocate_many(groups, batch.table.s_ns.max())
    assert len(set(got.tolist()) - free_before) == 6  # six slots came from evictions
    want = [single.allocate(g, single.table.s_ns.max()) for g in groups.tolist()]
    assert got.tolist() == want and (got >= 0).all()
    assert batch.table.free == single.table.free
    assert (batch.table.s_state == single.table.s_state).all() and (batch.table.s_row == single.table.s_row).all()
    assert batch.quotas.used.tolist() == single.quotas.used.tolist()


def test_evict_many_leaves_what_evicting_one_by_one_leaves() -> None:
    """Sealed slots of every group evicted as a batch and one by one on two identical spaces: two rows lose all
    their slots (interleaved: A's first, all of B, the rest of A, so B's row goes first), others some. The same
    table, free lists, rows freed in the same order, quotas and counters."""
    spaces = []
    for _ in range(2):
        m, _, _ = make(blocks=4)
        hs = hashes_of(m, prompt(9, 4))
        write(m, hs, range(4), state_at=state_blocks_for(PROFILE, 4))
        spaces.append(m._c.space)
    batch, single = spaces
    t = batch.table
    sealed = np.flatnonzero(t.s_state == BlockState.SEALED)
    rows = t.s_row[sealed]
    row_a, row_b = np.unique(rows)[:2]
    a, b = sealed[rows == row_a], sealed[rows == row_b]
    assert len(a) > 1
    rest = sealed[(rows != row_a) & (rows != row_b)][::3]
    batch.evict_many(np.concatenate([a[:1], b, a[1:], rest]))
    for slot in [*a[:1], *b, *a[1:], *rest]:
        single.evict(int(slot))
    bt, st = batch.table, single.table
    for name in ("s_state", "s_row", "s_gen", "s_pins", "s_leases", "e_slot", "e_gen", "e_verdict", "r_live"):
        assert (getattr(bt, name) == getattr(st, name)).all(), name
    assert bt.index == st.index and bt.r_hash == st.r_hash and bt.free == st.free and bt.next_gen == st.next_gen
    assert bt._free_rows == st._free_rows and bt._free_rows[-2:] == [row_b, row_a]
    assert batch.quotas.used.tolist() == single.quotas.used.tolist()
    assert batch._counters.snapshot() == single._counters.snapshot()


def test_layer4_batch_check_agrees_with_the_slot_views() -> None:
    space = _space(4)
    for g, pool in enumerate(space.pools):
        slots = np.arange(pool.n_slots + 2, dtype=np.int64) + int(space.table.base[g])  # two past the pool's end
        local, ok = space.locals(np.full(len(slots), g), slots)
        for i, s in enumerate(local.tolist()):
            view = pool.tensor[s * pool.slot_stride : s * pool.slot_stride + pool.slot_nbytes]
            whole = view.numel() == pool.slot_nbytes and view.data_ptr() % 128 == 0
            assert bool(ok[i]) == whole, (pool.group, s)
        assert ok[: pool.n_slots].all() and not ok[pool.n_slots :].any()
