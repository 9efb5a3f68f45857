"""The slot space: the pools of one topology, their slot table and quotas, and allocation / eviction.

Built whole from byte budgets (a resize builds a new one); not thread-safe on its own (the manager
holds the lock).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

import numpy as np
import torch

from kvtier.core import hugepages
from kvtier.core.errors import LayoutError
from kvtier.core.forms import CacheForm, GroupKind, Reason
from kvtier.core.layout import POOL_ALIGNMENT, slot_stride
from kvtier.core.profile import ModelProfile
from kvtier.gpu.admission import AdmissionConfig, FormQuotas
from kvtier.gpu.counters import Counters
from kvtier.gpu.errors import AdmissionRefused, BudgetError
from kvtier.gpu.gentable import GenerationTable
from kvtier.gpu.page_move import start_moving
from kvtier.gpu.pools import Pool, allocate_pool
from kvtier.gpu.states import BlockState
from kvtier.gpu.table import BlockTable

log = logging.getLogger(__name__)


def _slots_per_form(profile: ModelProfile, budgets: Mapping[CacheForm, int]) -> dict[CacheForm, int]:
    """How many blocks each form's budget holds (every group of the form has one slot per block)."""
    h = profile.hash_block_tokens
    slots_for: dict[CacheForm, int] = {}
    for form in dict.fromkeys(g.form for g in profile.groups):
        if form not in budgets:
            raise BudgetError(
                f"budgets_bytes has no entry for form {form.value}; give every form of the profile a byte budget"
            )
        groups = [g for g in profile.groups if g.form is form]
        per_block = sum(slot_stride(g.object_bytes(h)) for g in groups)
        slots_for[form] = budgets[form] // per_block
        if slots_for[form] < 1:
            raise BudgetError(
                f"the {form.value} budget ({budgets[form]} B) holds no block of its groups "
                f"({per_block} B per block); raise it"
            )
    return slots_for


def _log_huge_pages(profile: str, pools: tuple[Pool, ...]) -> None:
    """Say how much of the cpu pools the kernel put on huge pages: it decides how large the disk's read requests
    into them can be (kvtier.core.hugepages), and only its settings can change it."""
    total = sum(p.tensor.numel() for p in pools)
    try:
        huge = hugepages.huge_bytes((p.address, p.tensor.numel()) for p in pools)
    except OSError as exc:  # no /proc (an unusual container): the pools work the same, only this line is lost
        log.info("%s pools: %d MiB (huge pages unknown: %s)", profile, total >> 20, exc)
        return
    kinds = ", ".join(sorted({p.pages for p in pools}))
    if any(p.move is not None for p in pools):
        hint = "; the rest is being moved onto huge pages (MADV_COLLAPSE: a line says when done)"
    else:
        hint = "" if huge else " (`kvtier doctor` says how to give them huge pages: docs/systemd.md)"
    log.info("%s pools: %d MiB, %d MiB of it on huge pages (%s)%s", profile, total >> 20, huge >> 20, kinds, hint)


class SlotSpace:
    """Pools, slot table and form quotas of one topology; hands out FREE slots, evicting as needed."""

    def __init__(
        self,
        profile: ModelProfile,
        budgets: Mapping[CacheForm, int],
        device: torch.device,
        cfg: AdmissionConfig,
        counters: Counters,
    ) -> None:
        h = profile.hash_block_tokens
        slots_for = _slots_per_form(profile, budgets)
        self.names = tuple(g.name for g in profile.groups)
        self.forms = tuple(g.form for g in profile.groups)
        self.pools: tuple[Pool, ...] = tuple(
            allocate_pool(
                g.name,
                g.form,
                g.object_bytes(h),
                slots_for[g.form] * slot_stride(g.object_bytes(h)),
                device,
            )
            for g in profile.groups
        )
        for pool in self.pools:
            if pool.address % POOL_ALIGNMENT or pool.slot_stride % POOL_ALIGNMENT or not pool.tensor.is_contiguous():
                raise LayoutError(
                    f"pool {pool.group} is not {POOL_ALIGNMENT}-B aligned and contiguous; this is a kvtier bug, "
                    "please report it"
                )
        if device.type == "cpu":
            _log_huge_pages(profile.name, self.pools)
            start_moving(profile.name, [p.move for p in self.pools if p.move is not None])  # (onto huge pages)
        # per group, what layer 4 checks a slot against (one array gather per batch instead of a view per slot)
        self._address = np.array([p.address for p in self.pools], dtype=np.int64)
        self._stride = np.array([p.slot_stride for p in self.pools], dtype=np.int64)
        self._nbytes = np.array([p.slot_nbytes for p in self.pools], dtype=np.int64)
        self._extent = np.array([p.tensor.numel() for p in self.pools], dtype=np.int64)
        self._counters = counters
        self.gform = [counters.form_index(f) for f in self.forms]
        history = [g.kind is GroupKind.HISTORY for g in profile.groups]
        self.generations = GenerationTable(sum(p.n_slots for p in self.pools))
        self.table = t = BlockTable([p.n_slots for p in self.pools], history, self.generations.gens)
        capacity = np.zeros(len(counters.forms), dtype=np.int64)
        for g, pool in enumerate(self.pools):
            capacity[self.gform[g]] += pool.n_slots
        self.quotas = FormQuotas(capacity, cfg)
        self._pool_slice = [slice(int(t.base[g]), int(t.base[g]) + p.n_slots) for g, p in enumerate(self.pools)]
        self._s_form = np.array(self.gform)[t.s_group]

    def allocate(self, g: int, live_ns: int) -> int:
        """A FREE slot of group g within the entry cap, evicting as needed: from g's own pool when it is
        full, else (cap reached) from forms above their reservation; stale namespace, then state forms,
        then history, least recently used within."""
        t, q, f = self.table, self.quotas, self.gform[g]
        q.demand(f)
        while True:
            if t.free[g] and not q.global_full():
                q.used[f] += 1
                return t.free[g].pop()
            if not t.free[g]:
                where: slice | np.ndarray = self._pool_slice[g]
            else:
                over = q.over_quota()
                where = over[self._s_form] if over.any() else slice(None)
            victim = t.victim(where, live_ns)
            if victim < 0:
                raise AdmissionRefused(
                    f"no room for a {self.names[g]} object: every candidate is pinned, leased or in flight; "
                    f"release leases or unpin blocks, or raise the {self.forms[g].value} budget / entry cap"
                )
            self.evict(victim)

    def allocate_many(self, groups: np.ndarray, live_ns: int) -> np.ndarray:
        """A FREE slot for each object of a batch (`groups`: its group), in order; -1 where `allocate` refuses.
        Where pools are short of free slots and the entry cap does not bind, their victims are chosen and evicted
        at once; then, when the free lists hold the batch within the cap, it takes them in a few array
        operations; otherwise it allocates one by one, evicting as `allocate` does."""
        t, q = self.table, self.quotas
        counts = np.bincount(groups, minlength=t.n_groups).tolist()
        short = [max(0, n - len(t.free[g])) for g, n in enumerate(counts)]
        if any(short) and int(q.used.sum()) + len(groups) - sum(short) <= q.max_entries:
            # Pools that run dry make their room at once: one by one, `allocate` would evict the same slots (from
            # the group's own pool, least valued first) and never meet the entry cap.
            found = [t.victims(self._pool_slice[g], live_ns, n) if n else None for g, n in enumerate(short)]
            if all(v is None or len(v) == n for v, n in zip(found, short)):
                for g, v in enumerate(found):
                    if v is None:
                        continue
                    free = t.free[g]
                    kept = len(free)
                    self.evict_many(v)
                    # one by one, the free slots go first, then each victim as it is evicted: pop order
                    free[:] = free[kept:][::-1] + free[:kept]
        if int(q.used.sum()) + len(groups) > q.max_entries or any(len(t.free[g]) < n for g, n in enumerate(counts)):
            out = np.full(len(groups), -1, dtype=np.int64)
            for i, g in enumerate(groups.tolist()):
                with contextlib.suppress(AdmissionRefused):
                    out[i] = self.allocate(g, live_ns)
            return out
        out = np.empty(len(groups), dtype=np.int64)
        per_form = np.zeros_like(q.used)
        for g, n in enumerate(counts):
            if n:
                free = t.free[g]
                out[groups == g] = free[: -n - 1 : -1]  # the order `pop` would give
                del free[-n:]
                per_form[self.gform[g]] += n
        q.used += per_form
        q.demand_counts(per_form)
        return out

    def unallocate(self, g: int, slot: int) -> None:
        """Return a slot `allocate` just gave out and nothing was bound to."""
        self.table.free[g].append(slot)
        self.quotas.used[self.gform[g]] -= 1

    def evict(self, slot: int) -> None:
        """SEALED -> EVICTING -> FREE; lookups then report the object `evicted`."""
        t = self.table
        t.move(slot, BlockState.EVICTING)
        t.move(slot, BlockState.FREE)
        self.free(slot, Reason.EVICTED)
        self._counters.event("evictions", self.gform[int(t.s_group[slot])])

    def evict_many(self, slots: np.ndarray) -> None:
        """`evict` for a batch of slots, in order, in a few array operations (a recovery into full pools evicts as
        many objects as it loads, and bench/daemon.py's loads allocated their slots faster this way than evicting
        one by one)."""
        t = self.table
        rows = t.evict_many(slots, Reason.EVICTED)
        for g, slot in zip(t.s_group[slots].tolist(), slots.tolist()):
            t.free[g].append(slot)
        counts = np.bincount(self._s_form[slots], minlength=len(self.quotas.used))
        self.quotas.used -= counts
        for f in np.flatnonzero(counts).tolist():
            self._counters.event("evictions", f, int(counts[f]))
        # a row goes once its last slot of the batch has (as one by one): in the order of those last slots
        last = len(rows) - 1 - np.unique(rows[::-1], return_index=True)[1]
        for row in rows[np.sort(last)].tolist():
            t.drop_row_if_dead(row)

    def evict_unpinned(self, slot: int) -> bool:
        """Evict a sealed slot now unless it is pinned (leases do not protect it); True if it went."""
        t = self.table
        if t.s_state[slot] != BlockState.SEALED or t.s_pins[slot]:
            return False
        self.evict(slot)
        return True

    def free(self, slot: int, marker: Reason) -> None:
        """Unbind a slot that just became FREE, return it to its pool, drop its row if nothing holds it."""
        t = self.table
        g = int(t.s_group[slot])
        row = t.unbind(slot, marker)
        self.unallocate(g, slot)
        t.drop_row_if_dead(row)

    def local(self, g: int, slot: int) -> int:
        """Layer 4 for one object: the slot's bytes are 128-B aligned, contiguous and exactly the object;
        returns the slot's index within its group's pool."""
        local = slot - int(self.table.base[g])
        if not self._whole_and_aligned(g, local):
            raise LayoutError(f"{self.names[g]} slot {local} is misaligned; this is a kvtier bug, please report it")
        return local

    def locals(self, groups: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Layer 4 for a batch: each slot's index within its pool, and whether its bytes pass `local`'s check."""
        local = slots - self.table.base[groups]
        return local, np.asarray(self._whole_and_aligned(groups, local))

    def _whole_and_aligned(self, g: int | np.ndarray, local: int | np.ndarray) -> bool | np.ndarray:
        """The slot view's address is aligned and it lies whole inside its (contiguous) pool: `slot_view`'s
        facts by arithmetic on the pool's address, stride and size; works on one slot or on arrays."""
        start = local * self._stride[g]
        return (
            (local >= 0)
            & ((self._address[g] + start) % POOL_ALIGNMENT == 0)
            & (start + self._nbytes[g] <= self._extent[g])
        )

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        self.generations.close()
