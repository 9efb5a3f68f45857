"""The invariant check of a CacheManager's slot space: slot table, index, quotas, leases and pools."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvtier.core.forms import Reason
from kvtier.core.layout import POOL_ALIGNMENT
from kvtier.gpu.leases import LeaseSet
from kvtier.gpu.slots import SlotSpace
from kvtier.gpu.states import BlockState
from kvtier.gpu.table import IN_FLIGHT


def invariant_violations(space: SlotSpace, leases: Iterable[LeaseSet], live_ns: int, queued: int) -> list[str]:
    """Cross-check every invariant; returns the violations (empty when all hold)."""
    t = space.table
    leases = list(leases)
    bad: list[str] = []
    state = t.s_state
    free = state == BlockState.FREE
    if np.isin(state, (BlockState.EVICTING,)).any():
        bad.append("a slot was left EVICTING")
    listed = np.zeros(t.n_slots, dtype=np.int64)
    for lst in t.free:
        np.add.at(listed, np.array(lst, dtype=np.intp), 1)
    if not np.array_equal(listed, free.astype(np.int64)):
        bad.append("free lists and FREE slots disagree (a slot in two states or lost)")
    bound = ~free
    rows = t.s_row[bound]
    groups = t.s_group[bound]
    ids = np.flatnonzero(bound)
    if (rows == t.sentinel).any() or (t.s_row[free] != t.sentinel).any():
        bad.append("slot-row links broken")
    elif not (np.array_equal(t.e_slot[groups, rows], ids) and np.array_equal(t.e_gen[groups, rows], t.s_gen[ids])):
        bad.append("index entries do not point back at their slots / generations")
    expect = np.select(
        [state[ids] == BlockState.WRITING, state[ids] == BlockState.RECOVERING, t.s_ns[ids] == live_ns],
        [Reason.PARTIAL_BLOCK, IN_FLIGHT, Reason.OK],
        Reason.STALE_VERSION,
    )
    if rows.size != 0 and not np.array_equal(t.e_verdict[groups, rows], expect.astype(np.int8)):
        bad.append("verdicts disagree with slot states")
    if int((t.e_verdict == Reason.OK).sum()) != int(((state == BlockState.SEALED) & (t.s_ns == live_ns)).sum()):
        bad.append("an entry says OK without a sealed live slot behind it")
    live_rows = np.bincount(rows, minlength=t.sentinel + 1)
    if not np.array_equal(live_rows, t.r_live):
        bad.append("row live counts are wrong")
    for h, row in t.index.items():
        if t.r_hash[row] != h:
            bad.append("index and row hashes disagree")
            break
    if sum(h is not None for h in t.r_hash) != len(t.index):
        bad.append("rows outside the index")
    row_leases = np.zeros_like(t.r_leases)
    slot_leases = np.zeros_like(t.s_leases)
    for lease in leases:
        row_leases[lease.held_rows] += 1  # a lease holds a row once however often its lookup named it, as hold_rows
        for slot, gen in lease.held_slots:
            if t.s_gen[slot] == gen:
                slot_leases[slot] += 1
    if not np.array_equal(row_leases[:-1], t.r_leases[:-1]) or not np.array_equal(slot_leases, t.s_leases):
        bad.append("lease counts disagree with live leases")
    unindexed = np.fromiter((h is None for h in t.r_hash), dtype=bool, count=len(t.r_hash))
    if (t.r_leases[:-1][unindexed] > 0).any():
        bad.append("a leased row was unindexed under its lease")
    used = np.zeros_like(space.quotas.used)
    np.add.at(used, np.array(space.gform)[t.s_group[bound]], 1)
    if not np.array_equal(used, space.quotas.used):
        bad.append("quota usage disagrees with occupied slots")
    if int((state == BlockState.RECOVERING).sum()) != t.n_recovering:
        bad.append("recovering count is wrong")
    if queued != sum(lease.reserved for lease in leases):
        bad.append("the recovery queue's reservations disagree with live leases")
    if any(p.address % POOL_ALIGNMENT for p in space.pools):
        bad.append("a pool lost its alignment")
    return bad
