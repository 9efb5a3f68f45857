"""CacheManager: the GPU-resident cache of one profile: pools, lookups with leases, writes, recovery.

One re-entrant lock guards all state. Lookups run under it (including the lower tier's `has`,
an index probe); bulk I/O (`load_into`, `store`) runs outside it on slots that are RECOVERING or
pinned, so no one else can touch them. Pools are allocated once; `resize` is refused outside
`recompile_window()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from kvtier.core.checkvector import CheckVector, HitGeometry, window_blocks
from kvtier.core.errors import LayoutError, VersionError
from kvtier.core.forms import CacheForm, GroupKind, Reason, Route
from kvtier.core.layout import POOL_ALIGNMENT
from kvtier.core.profile import ModelProfile
from kvtier.core.tier import LoadRequest, LowerTier, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.gpu.admission import AdmissionConfig, FormQuotas
from kvtier.gpu.coordinator import Coordinator
from kvtier.gpu.counters import Counters, CounterSnapshot
from kvtier.gpu.errors import AdmissionRefused, BadKey, BudgetError, PartialBlock, StaleHandle, TopologyError
from kvtier.gpu.leases import Handle, LeaseBook, LeaseSet, WriteHandle
from kvtier.gpu.pools import Pool, allocate_pool
from kvtier.gpu.states import BlockState, CacheBlockState
from kvtier.gpu.table import IN_FLIGHT, BlockTable

log = logging.getLogger(__name__)
_REUSE = int(Route.REUSE)  # plain int: numpy compares against an IntEnum member slowly (__array_ufunc__ lookup)

_NO_ROWS = np.zeros(0, dtype=np.intp)


@dataclasses.dataclass(slots=True)
class LookupResult:
    """What a lookup answers: the check vector and the lease that keeps its REUSE objects readable."""

    check_vector: CheckVector
    leases: LeaseSet


def _window_sum(x: np.ndarray, n: int) -> np.ndarray:
    """out[k-1] = sum of x[max(0, k-n):k] for k = 1..len(x)."""
    c = np.concatenate(([0], np.cumsum(x, dtype=np.int64)))
    ks = np.arange(1, len(x) + 1)
    return c[ks] - c[np.maximum(ks - n, 0)]


def _lease_of(item: LookupResult | LeaseSet) -> LeaseSet:
    return item.leases if isinstance(item, LookupResult) else item


class CacheManager:
    """The GPU-resident cache manager for one model profile (one live namespace at a time)."""

    def __init__(
        self,
        profile: ModelProfile,
        *,
        budgets_bytes: Mapping[CacheForm | str, int],
        device: str | torch.device = "cpu",
        lower: LowerTier | None = None,
        admission: AdmissionConfig | None = None,
        lease_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be > 0")
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self.device = torch.device(device)
        self._lower = lower
        self._cfg = admission or AdmissionConfig()
        self._ttl = lease_ttl_s
        self._clock = clock
        self._names = tuple(g.name for g in profile.groups)
        self._group_ix = {name: i for i, name in enumerate(self._names)}
        self._forms = tuple(g.form for g in profile.groups)
        self._history = [g.kind is GroupKind.HISTORY for g in profile.groups]
        n_state = window_blocks(profile)
        self._state_windows = [(g, int(n)) for g, n in enumerate(n_state) if n]
        self._hist_groups = np.flatnonzero(n_state == 0)
        self._coordinator = Coordinator(profile, self._cfg.state_probe_boundaries)
        self._counters = Counters(self._forms)
        self._gform = [self._counters.form_index(f) for f in self._forms]
        self._ns_ids: dict[bytes, int] = {}
        self._profile = profile
        self._geometry = HitGeometry.of(profile)
        self._use_version(profile.version)
        self._book = LeaseBook()
        self._queued = 0
        self._window_depth = 0
        self._topology_epoch = 0
        self._build(budgets_bytes)

    # ------------------------------------------------------------------------------------------
    # topology

    def _build(self, budgets_bytes: Mapping[CacheForm | str, int]) -> None:
        budgets = {CacheForm(k): int(v) for k, v in budgets_bytes.items()}
        h = self._profile.hash_block_tokens
        slots_for: dict[CacheForm, int] = {}
        for form in dict.fromkeys(self._forms):
            if form not in budgets:
                raise BudgetError(
                    f"budgets_bytes has no entry for form {form.value}; give every form of the profile a byte budget"
                )
            groups = [g for g in self._profile.groups if g.form is form]
            per_block = sum(-(-g.object_bytes(h) // POOL_ALIGNMENT) * POOL_ALIGNMENT for g in groups)
            slots_for[form] = budgets[form] // per_block
            if slots_for[form] < 1:
                raise BudgetError(
                    f"the {form.value} budget ({budgets[form]} B) holds no block of its groups ({per_block} B per block); raise it"
                )
        self._pools = tuple(
            allocate_pool(
                g.name,
                g.form,
                g.object_bytes(h),
                slots_for[g.form] * -(-g.object_bytes(h) // POOL_ALIGNMENT) * POOL_ALIGNMENT,
                self.device,
            )
            for g in self._profile.groups
        )
        for pool in self._pools:
            if pool.address % POOL_ALIGNMENT or pool.slot_stride % POOL_ALIGNMENT:
                raise LayoutError(
                    f"pool {pool.group} is not {POOL_ALIGNMENT}-B aligned; this is a kvtier bug, please report it"
                )
        self._table = BlockTable([p.n_slots for p in self._pools], self._history)
        capacity = np.zeros(len(self._counters.forms), dtype=np.int64)
        for g, pool in enumerate(self._pools):
            capacity[self._gform[g]] += pool.n_slots
        self._quotas = FormQuotas(capacity, self._cfg)
        t = self._table
        self._pool_slice = [slice(int(t.base[g]), int(t.base[g]) + p.n_slots) for g, p in enumerate(self._pools)]
        self._s_form = np.array(self._gform)[t.s_group]

    @contextlib.contextmanager
    def recompile_window(self) -> Iterator[CacheManager]:
        """The only place pool addresses may change; holds the manager for its duration."""
        with self._lock:
            self._window_depth += 1
            try:
                yield self
            finally:
                self._window_depth -= 1

    def resize(self, budgets_bytes: Mapping[CacheForm | str, int]) -> None:
        """Reallocate every pool from new budgets: all cached objects, leases and writes are dropped."""
        with self._lock:
            if self._window_depth == 0:
                raise TopologyError(
                    "pool addresses change only inside `with manager.recompile_window():` (recapture CUDA graphs there)"
                )
            for lease in self._book.leases.values():
                lease.live = False
            self._book.clear()
            self._queued = 0
            old = self._pools
            self._build(budgets_bytes)
            for pool in old:
                pool.close()
            self._topology_epoch += 1
            self._cond.notify_all()

    @property
    def topology_epoch(self) -> int:
        return self._topology_epoch

    def pool_addresses(self) -> dict[str, int]:
        """Base address of every group's pool (unchanged between recompile windows)."""
        return {p.group: p.address for p in self._pools}

    def pools(self) -> tuple[Pool, ...]:
        """The pools: aligned uint8 tensors, slot stride and size, and (cpu) the memfd to map them by."""
        return self._pools

    # ------------------------------------------------------------------------------------------
    # versions

    def _use_version(self, version: VersionKey) -> None:
        self._profile = dataclasses.replace(self._profile, version=version)
        self._ns = version.namespace
        self._ns_id = self._ns_ids.setdefault(self._ns, len(self._ns_ids))
        self._digests = tuple(self._profile.layout(g).digest for g in self._profile.groups)

    def set_version(self, version: VersionKey) -> bytes:
        """Make `version` live (hot update): objects of other namespaces turn stale_version and go first."""
        with self._lock:
            if version.namespace != self._ns:
                self._use_version(version)
                t = self._table
                sealed = np.flatnonzero(t.s_state == BlockState.SEALED)
                live = t.s_ns[sealed] == self._ns_id
                verdict = np.where(live, Reason.OK, Reason.STALE_VERSION).astype(np.int8)
                t.e_verdict[t.s_group[sealed], t.s_row[sealed]] = verdict
            return self._ns

    @property
    def namespace(self) -> bytes:
        return self._ns

    @property
    def profile(self) -> ModelProfile:
        return self._profile

    def layout_digest(self, group: str) -> bytes:
        """The layout digest (kernel ABI included) a writer of `group` must name."""
        return self._digests[self._group(group)]

    # ------------------------------------------------------------------------------------------
    # lookup

    def lookup(
        self, block_hashes: Sequence[bytes], *, owner: Hashable = None, namespace: bytes | None = None
    ) -> LookupResult:
        """Route every object of the request's chained block hashes; lease the REUSE ones of the hit."""
        if namespace is not None and namespace != self._ns:
            raise VersionError(
                f"this cache serves namespace {self._ns.hex()}, not {namespace.hex()}; recompute block hashes with the live version key"
            )
        n = len(block_hashes)
        with self._lock:
            t = self._table
            now = self._clock()
            self._expire(now)
            rows = np.fromiter(map(t.index.get, block_hashes, itertools.repeat(t.sentinel)), dtype=np.intp, count=n)
            reasons = t.e_verdict.take(rows, axis=1)
            routes = (reasons != 0).view(np.int8)  # verdict OK -> REUSE (0), anything else -> RECOMPUTE (2)
            routes += routes  # (np.minimum / <<= with a Python scalar take numpy's slow casting path)
            cv = CheckVector.build(self._geometry, routes, reasons)
            recovering = False
            if self._lower is not None and (cv.hit_blocks < n or t.n_recovering):
                # the resident hit is short: ask the lower tier about what could extend it
                if t.n_recovering:
                    inflight = reasons == IN_FLIGHT
                    routes[inflight] = Route.RECOVER
                    reasons[inflight] = Reason.OK
                asked = [0]

                def ask(gs: np.ndarray, bs: np.ndarray) -> np.ndarray:
                    asked[0] += len(gs)
                    return self._ask_lower(block_hashes, gs, bs)

                room = max(0, self._cfg.max_recover_queue - self._queued - t.n_recovering)
                squeezed = self._coordinator.find(routes, reasons, ask, room)
                recovering = bool(asked[0]) or bool(t.n_recovering)
                if recovering:
                    cv = CheckVector.build(self._geometry, routes, reasons)
            n_recover = 0
            if recovering:
                cv, n_recover = self._admit_recoveries(cv, routes, reasons, squeezed)
            k = cv.hit_blocks
            lease = LeaseSet(
                lease_id=self._book.next_id(),
                owner=owner,
                namespace=self._ns,
                expires_at=now + self._ttl,
                block_hashes=tuple(block_hashes) if recovering else (),
                rows=rows,
                gens=t.e_gen.take(rows[:k], axis=1),
                routes=routes,
                reasons=reasons,
                held_rows=_NO_ROWS,
                held_slots=[],
                reserved=n_recover,
            )
            self._queued += n_recover
            self._hold(lease, cv)
            self._counters.record_lookup(cv.routes, cv.reasons)
            self._book.add_lease(lease)
        return LookupResult(cv, lease)

    def _ask_lower(self, block_hashes: Sequence[bytes], gs: np.ndarray, bs: np.ndarray) -> np.ndarray:
        """The lower tier's `has` for objects (gs[i], bs[i]); any failure of the tier reads as missing."""
        assert self._lower is not None
        ns, names, forms = self._ns, self._names, self._forms
        try:
            keys = [ObjectKey(ns, block_hashes[b], names[g], forms[g]) for g, b in zip(gs.tolist(), bs.tolist())]
        except ValueError as exc:
            raise BadKey(
                f"block hashes must be 16-byte digests ({exc}); hash blocks with kvtier.core.block_hashes"
            ) from None
        missing = np.full(len(keys), Reason.MISSING, dtype=np.int8)
        try:
            answers = np.fromiter(self._lower.has(keys, [self._digests[g] for g in gs.tolist()]), dtype=np.int8)
        except Exception:
            log.exception("lower tier failed to answer has() for %d objects; treating them as missing", len(keys))
            return missing
        if len(answers) != len(keys):
            log.error("lower tier answered %d of %d has() queries; treating them as missing", len(answers), len(keys))
            return missing
        return answers

    def _admit_recoveries(
        self, cv: CheckVector, routes: np.ndarray, reasons: np.ndarray, squeezed: bool
    ) -> tuple[CheckVector, int]:
        """Fit the recoveries to the queue's room: the hit becomes the largest boundary whose RECOVER
        objects (history before it, state in its window) fit; every other RECOVER is RECOMPUTE `admission`
        (when the room is what stopped the hit: `squeezed`, or too many were wanted)."""
        wanted = int(np.count_nonzero(cv.routes == Route.RECOVER))
        room = max(0, self._cfg.max_recover_queue - self._queued - self._table.n_recovering)
        if wanted <= room and not squeezed:
            return cv, wanted
        k_max = cv.hit_blocks
        recover = routes[:, :k_max] == Route.RECOVER
        servable = routes[:, :k_max] != Route.RECOMPUTE
        need = np.cumsum(recover[self._hist_groups].sum(axis=0))  # need[k-1]: history recoveries below k
        fits = np.ones(k_max, dtype=bool)
        for g, n_s in self._state_windows:
            fits &= _window_sum(~servable[g], n_s) == 0
            need = need + _window_sum(recover[g], n_s)
        ks = np.flatnonzero(fits & (need <= room))
        k = int(ks[-1]) + 1 if ks.size else 0
        keep = np.zeros_like(routes, dtype=bool)
        keep[self._hist_groups, :k] = True
        for g, n_s in self._state_windows:
            keep[g, max(0, k - n_s) : k] = True
        cut = (routes == Route.RECOVER) & ~keep
        routes[cut] = Route.RECOMPUTE
        reasons[cut] = Reason.ADMISSION
        cv = CheckVector.build(self._geometry, routes, reasons)
        return cv, int(np.count_nonzero(cv.routes == Route.RECOVER))

    def _hold(self, lease: LeaseSet, cv: CheckVector) -> None:
        """Protect the hit: history objects of its rows, state objects of its window, from pressure eviction."""
        t = self._table
        k = cv.hit_blocks
        held = lease.rows[:k].copy()
        t.r_leases[held] += 1
        t.touch_rows(held)
        slots: list[tuple[int, int]] = []
        for g, n_s in self._state_windows:
            for b in range(max(0, k - n_s), k):
                if cv.routes[g, b] == _REUSE:
                    slot = int(t.e_slot[g, lease.rows[b]])
                    t.s_leases[slot] += 1
                    t.s_touch[slot] = t.tick
                    slots.append((slot, int(t.s_gen[slot])))
        lease.held_rows = held
        lease.held_slots = slots

    def _unhold(self, lease: LeaseSet) -> None:
        self._let_go(lease.held_rows, lease.held_slots)
        lease.held_rows = _NO_ROWS
        lease.held_slots = []

    def _let_go(self, held: np.ndarray, held_slots: list[tuple[int, int]]) -> None:
        """Undo one `_hold`; rows left with no slot and no lease are unindexed."""
        t = self._table
        t.r_leases[held] -= 1
        for slot, gen in held_slots:
            if t.s_gen[slot] == gen:
                t.s_leases[slot] -= 1
        dead = held[(t.r_live[held] == 0) & (t.r_leases[held] == 0)]
        for row in np.unique(dead).tolist():
            t.drop_row_if_dead(row)

    # ------------------------------------------------------------------------------------------
    # leases

    def handle(self, result: LookupResult, group: str, block: int) -> Handle:
        """The handle of one REUSE object of a lookup (raises StaleHandle if it has gone since)."""
        lease = result.leases
        g = self._group(group)
        cv = result.check_vector
        if not 0 <= block < cv.hit_blocks or cv.routes[g, block] != Route.REUSE:
            raise BadKey(
                f"{group} block {block} is not REUSE in this lookup; read only the objects the check vector routes REUSE"
            )
        with self._lock:
            self._expire(self._clock())
            self._require_live(lease)
            slot = int(self._table.e_slot[g, lease.rows[block]])
            gen = int(lease.gens[g, block])
            if slot < 0 or self._table.s_gen[slot] != gen:
                raise StaleHandle(f"{group} block {block} was evicted after the lookup; look the prefix up again")
        local = slot - int(self._table.base[g])
        pool = self._pools[g]
        return Handle(
            lease.lease_id,
            group,
            block,
            local,
            gen,
            self._forms[g],
            lease.namespace,
            local * pool.slot_stride,
            pool.slot_nbytes,
        )

    def handles(self, result: LookupResult) -> list[Handle]:
        """Handles of every REUSE object of a lookup, block-major."""
        return [
            self.handle(result, self._names[g], int(b))
            for b, g in np.argwhere(result.check_vector.routes.T == Route.REUSE)
        ]

    def read(self, handle: Handle, *, copy: bool = False) -> torch.Tensor:
        """The object's bytes (uint8): a view of the slot, or with copy=True a copy taken while it is known good."""
        with self._lock:
            self._check_handle(handle)
            view = self._pools[self._group_ix[handle.group]].slot_view(handle.slot)
            return view.clone() if copy else view

    def valid(self, handle: Handle) -> bool:
        """Whether a handle still names its object (check after using a zero-copy view)."""
        try:
            with self._lock:
                self._check_handle(handle)
        except StaleHandle:
            return False
        return True

    def _check_handle(self, handle: Handle) -> None:
        lease = self._book.leases.get(handle.lease_id)
        now = self._clock()
        if lease is not None and lease.expires_at <= now:
            self._expire(now)
        if lease is None or not lease.live:
            raise StaleHandle("the lease was released or expired; look the prefix up again")
        g = self._group_ix[handle.group]
        slot = int(self._table.base[g]) + handle.slot
        if self._table.s_gen[slot] != handle.generation or self._table.s_state[slot] != BlockState.SEALED:
            raise StaleHandle(
                f"{handle.group} block {handle.block} was evicted (generation moved); recompute or look up again"
            )

    def _require_live(self, lease: LeaseSet) -> None:
        if not lease.live:
            raise StaleHandle("the lease was released or expired; look the prefix up again")

    def release(self, *items: LookupResult | LeaseSet | Iterable[LookupResult | LeaseSet]) -> int:
        """Give back leases (idempotent); returns how many were still live."""
        flat: list[LookupResult | LeaseSet] = []
        for item in items:
            flat.extend([item] if isinstance(item, (LookupResult, LeaseSet)) else item)
        n = 0
        with self._lock:
            for item in flat:
                lease = _lease_of(item)
                if lease.live:
                    self._release_lease(lease)
                    self._counters.totals["leases_released"] += 1
                    n += 1
        return n

    def release_owner(self, owner: Hashable) -> int:
        """Release every lease and abort every write of an owner (a client that went away)."""
        n = 0
        with self._lock:
            for ident in self._book.of_owner(owner):
                lease = self._book.leases.get(ident)
                if lease is not None:
                    self._release_lease(lease)
                    n += 1
                elif ident in self._book.writes:
                    self._abort_write(self._book.writes[ident][0])
                    n += 1
        return n

    def _release_lease(self, lease: LeaseSet) -> None:
        lease.live = False
        self._unhold(lease)
        self._queued -= lease.reserved
        lease.reserved = 0
        self._book.drop(lease.lease_id)
        self._cond.notify_all()

    def _expire(self, now: float) -> None:
        for ident in self._book.due(now):
            lease = self._book.leases.get(ident)
            if lease is not None:
                self._release_lease(lease)
                self._counters.totals["leases_expired"] += 1
                log.debug("lease %d of %r expired after %.1f s without release", ident, lease.owner, self._ttl)
            else:
                self._abort_write(self._book.writes[ident][0])
                self._counters.totals["writes_expired"] += 1

    # ------------------------------------------------------------------------------------------
    # writes (the offload path)

    def begin_write(self, key: ObjectKey, *, layout_digest: bytes, owner: Hashable = None) -> WriteHandle | None:
        """Reserve a slot for a new object; None if it is already cached or being filled by someone else."""
        g = self._check_key(key)
        if layout_digest != self._digests[g]:
            raise LayoutError(
                f"{key.group}: the writer's layout digest {layout_digest.hex()} is not the live kernels' "
                f"{self._digests[g].hex()}; write with the current kernel ABI and layout"
            )
        with self._lock:
            t = self._table
            now = self._clock()
            self._expire(now)
            row = t.index.get(key.block_hash)
            if row is not None:
                verdict = t.e_verdict[g, row]
                if verdict in (Reason.OK, Reason.PARTIAL_BLOCK, IN_FLIGHT):
                    return None
                old = int(t.e_slot[g, row])
                if old >= 0 and not self._evict_explicit(old):
                    raise AdmissionRefused(f"{key.group}: a stale copy of this block is pinned; unpin it first")
            slot = self._allocate(g)
            try:
                row = t.row(key.block_hash)  # after allocating: an eviction may have dropped the old row
            except AdmissionRefused:
                t.free[g].append(slot)
                self._quotas.used[self._gform[g]] -= 1
                raise
            t.move(slot, BlockState.WRITING)
            gen = t.bind(slot, row, Reason.PARTIAL_BLOCK, self._ns_id)
            local = self._check_slot(g, slot)
            pool = self._pools[g]
            handle = WriteHandle(
                self._book.next_id(), key, local, gen, local * pool.slot_stride, pool.slot_nbytes, owner
            )
            self._book.add_write(handle, now + self._ttl)
            return handle

    def seal(self, handle: WriteHandle, *, written_bytes: int) -> None:
        """Seal a written object: it must be whole (written_bytes == nbytes), else it is dropped."""
        g = self._group_ix[handle.key.group]
        with self._lock:
            t = self._table
            slot = int(t.base[g]) + handle.slot
            live = handle.write_id in self._book.writes
            if not live or t.s_gen[slot] != handle.generation or t.s_state[slot] != BlockState.WRITING:
                raise StaleHandle("the write handle expired or was aborted; begin the write again")
            if written_bytes != handle.nbytes:
                self._abort_write(handle)
                raise PartialBlock(
                    f"{handle.key.group}: sealed after {written_bytes} of {handle.nbytes} bytes; a block is sealed only "
                    "when whole: begin the write again and fill all of it"
                )
            self._book.drop(handle.write_id)
            t.move(slot, BlockState.SEALED)
            t.set_verdict(slot, Reason.OK if t.s_ns[slot] == self._ns_id else Reason.STALE_VERSION)
            t.touch_slot(slot)
            self._counters.event("writes_sealed", self._gform[g])

    def abort(self, handle: WriteHandle) -> bool:
        """Drop an unsealed write (idempotent); returns whether it was still open."""
        with self._lock:
            if handle.write_id not in self._book.writes:
                return False
            self._abort_write(handle)
            return True

    def write_block(
        self, key: ObjectKey, payload: torch.Tensor, *, layout_digest: bytes, owner: Hashable = None
    ) -> bool:
        """begin_write + copy + seal for in-process writers; False if the object was already cached."""
        data = payload.detach().contiguous().reshape(-1).view(torch.uint8)
        with self._lock:
            handle = self.begin_write(key, layout_digest=layout_digest, owner=owner)
            if handle is None:
                return False
            if data.numel() == handle.nbytes:
                self._pools[self._group_ix[key.group]].slot_view(handle.slot).copy_(data)
            self.seal(handle, written_bytes=data.numel())
            return True

    def _abort_write(self, handle: WriteHandle) -> None:
        self._book.drop(handle.write_id)
        g = self._group_ix[handle.key.group]
        t = self._table
        slot = int(t.base[g]) + handle.slot
        if t.s_gen[slot] == handle.generation and t.s_state[slot] == BlockState.WRITING:
            t.move(slot, BlockState.FREE)
            self._free_slot(slot, Reason.MISSING)
            self._counters.event("writes_aborted", self._gform[g])

    def _check_key(self, key: ObjectKey) -> int:
        g = self._group_ix.get(key.group)
        if g is None or self._forms[g] is not key.form:
            raise BadKey(
                f"profile {self._profile.name} has no {key.form.value} group {key.group!r}; name a group of the profile"
            )
        if key.namespace != self._ns:
            raise VersionError(
                f"namespace {key.namespace.hex()} is not live ({self._ns.hex()}); write under the live version key"
            )
        return g

    def _check_slot(self, g: int, slot: int) -> int:
        """Layer 4 for one object: the slot's bytes are 128-B aligned, contiguous and exactly the object."""
        local = slot - int(self._table.base[g])
        view = self._pools[g].slot_view(local)
        if view.data_ptr() % POOL_ALIGNMENT or not view.is_contiguous() or view.numel() != self._pools[g].slot_nbytes:
            raise LayoutError(f"{self._names[g]} slot {local} is misaligned; this is a kvtier bug, please report it")
        return local

    # ------------------------------------------------------------------------------------------
    # allocation and eviction

    def _allocate(self, g: int) -> int:
        """A FREE slot of group g within the entry cap, evicting as needed: from g's own pool when it is
        full, else (cap reached) from forms above their reservation; stale namespace, then state forms,
        then history, least recently used within."""
        t, q, f = self._table, self._quotas, self._gform[g]
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
            victim = t.victim(where, self._ns_id)
            if victim < 0:
                raise AdmissionRefused(
                    f"no room for a {self._names[g]} object: every candidate is pinned, leased or in flight; "
                    f"release leases or unpin blocks, or raise the {self._forms[g].value} budget / entry cap"
                )
            self._evict_slot(victim)

    def _evict_slot(self, slot: int) -> None:
        t = self._table
        t.move(slot, BlockState.EVICTING)
        t.move(slot, BlockState.FREE)
        self._free_slot(slot, Reason.EVICTED)
        self._counters.event("evictions", self._gform[int(t.s_group[slot])])

    def _free_slot(self, slot: int, marker: Reason) -> None:
        """Unbind a slot that just became FREE, return it to its pool, drop its row if nothing holds it."""
        t = self._table
        g = int(t.s_group[slot])
        row = t.unbind(slot, marker)
        t.free[g].append(slot)
        self._quotas.used[self._gform[g]] -= 1
        t.drop_row_if_dead(row)

    def _evict_explicit(self, slot: int) -> bool:
        t = self._table
        if t.s_state[slot] != BlockState.SEALED or t.s_pins[slot]:
            return False
        self._evict_slot(slot)
        return True

    def evict(self, keys: Iterable[ObjectKey]) -> int:
        """Evict sealed, unpinned objects now (leaseholders then get StaleHandle); returns how many went."""
        n = 0
        with self._lock:
            for key in keys:
                slot = self._slot_of(key)
                if slot >= 0 and self._evict_explicit(slot):
                    n += 1
        return n

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        """Protect resident sealed objects from every eviction until unpinned; returns how many were pinned."""
        return self._pin(keys, +1)

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        return self._pin(keys, -1)

    def _pin(self, keys: Iterable[ObjectKey], delta: int) -> int:
        n = 0
        with self._lock:
            t = self._table
            for key in keys:
                slot = self._slot_of(key)
                if slot >= 0 and t.s_state[slot] == BlockState.SEALED and t.s_pins[slot] + delta >= 0:
                    t.s_pins[slot] += delta
                    n += 1
        return n

    def _slot_of(self, key: ObjectKey) -> int:
        g = self._check_key(key)
        row = self._table.index.get(key.block_hash)
        return -1 if row is None else int(self._table.e_slot[g, row])

    # ------------------------------------------------------------------------------------------
    # lower tier: recovery and write-back

    def recover(self, result: LookupResult, *, timeout_s: float | None = None) -> LookupResult:
        """Load the RECOVER objects of a lookup into slots (at most `max_recovering` at once across the
        manager; the rest wait), verify them, and lease them as REUSE; failures, and REUSE objects evicted
        since the lookup, become RECOMPUTE and the hit is recomputed. Returns the same result with its
        check vector updated."""
        lease = result.leases
        deadline = time.monotonic() + (self._cfg.recover_wait_s if timeout_s is None else timeout_s)
        with self._lock:
            self._expire(self._clock())
            self._require_live(lease)
            epoch = self._topology_epoch
            adopted: list[int] = []
        try:
            while True:
                with self._lock:
                    self._require_current(lease, epoch)
                    self._rebuild(result)  # objects evicted since the lookup turn RECOMPUTE first
                    pending = [(int(g), int(b)) for b, g in np.argwhere(result.check_vector.routes.T == Route.RECOVER)]
                if not pending:
                    return result
                self._recover_round(lease, pending, deadline, epoch, adopted)
        finally:
            with self._lock:
                if self._topology_epoch == epoch:
                    t = self._table
                    for row in adopted:
                        t.r_leases[row] -= 1
                        if t.drop_row_if_dead(row):
                            lease.rows[lease.rows == row] = t.sentinel
                self._queued -= lease.reserved
                lease.reserved = 0
                self._cond.notify_all()

    def _require_current(self, lease: LeaseSet, epoch: int) -> None:
        self._require_live(lease)
        if self._topology_epoch != epoch:
            raise StaleHandle("the pools were resized during recovery; look the prefix up again")

    def _recover_round(
        self, lease: LeaseSet, pending: list[tuple[int, int]], deadline: float, epoch: int, adopted: list[int]
    ) -> None:
        """Resolve every pending (group, block): adopt, wait for another recovery, or load in capped batches."""
        todo = deque(pending)
        waiting: list[tuple[int, int]] = []
        while todo:
            batch: list[tuple[int, int, int, LoadRequest, float]] = []
            with self._cond:
                self._require_current(lease, epoch)
                while todo and self._table.n_recovering < self._cfg.max_recovering:
                    g, b = todo.popleft()
                    claim = self._claim(lease, g, b, adopted)
                    if claim == "wait":
                        waiting.append((g, b))
                    elif claim is not None:
                        batch.append(claim)
                if not batch and todo:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        for g, b in todo:
                            self._fail(lease, g, b, Reason.ADMISSION)
                        todo.clear()
                    else:
                        self._cond.wait(min(remaining, 0.05))
                    continue
            if batch:
                answers = self._load([req for _, _, _, req, _ in batch])
                with self._cond:
                    if self._topology_epoch != epoch:
                        raise StaleHandle("the pools were resized during recovery; look the prefix up again")
                    # the slots are settled even if the lease died meanwhile: nothing stays RECOVERING
                    for (g, b, slot, _req, started), answer in zip(batch, answers):
                        self._finish_recovery(lease, g, b, slot, answer, started)
                    self._cond.notify_all()
        for g, b in waiting:
            with self._cond:
                while True:
                    self._require_current(lease, epoch)
                    t = self._table
                    row = lease.rows[b]
                    verdict = t.e_verdict[g, row]
                    if verdict != IN_FLIGHT:
                        if verdict == Reason.OK:
                            self._adopt(lease, g, b)
                        else:
                            self._fail(lease, g, b, Reason(int(verdict)))
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._fail(lease, g, b, Reason.ADMISSION)
                        break
                    self._cond.wait(min(remaining, 0.05))

    def _claim(self, lease: LeaseSet, g: int, b: int, adopted: list[int]) -> Any:
        """Decide one pending object: None (settled now), "wait", or a load-batch entry with its slot."""
        if lease.namespace != self._ns:  # the version moved since the lookup: never load stale objects
            self._fail(lease, g, b, Reason.STALE_VERSION)
            return None
        t = self._table
        row = int(lease.rows[b])
        if row == t.sentinel:
            try:
                row = t.row(lease.block_hashes[b])
            except AdmissionRefused:
                self._fail(lease, g, b, Reason.ADMISSION)
                return None
            lease.rows[b] = row
            t.r_leases[row] += 1  # keeps the new row indexed until the lease holds it
            adopted.append(row)
        verdict = t.e_verdict[g, row]
        if verdict == Reason.OK:
            self._adopt(lease, g, b)
            return None
        if verdict == IN_FLIGHT:
            return "wait"
        if verdict not in (Reason.MISSING, Reason.EVICTED):
            self._fail(lease, g, b, Reason(verdict))
            return None
        try:
            slot = self._allocate(g)
        except AdmissionRefused:
            self._fail(lease, g, b, Reason.ADMISSION)
            return None
        t.move(slot, BlockState.RECOVERING)
        t.bind(slot, row, IN_FLIGHT, self._ns_id)
        local = self._check_slot(g, slot)
        key = ObjectKey(self._ns, t.r_hash[row], self._names[g], self._forms[g])
        request = LoadRequest(key, self._pools[g].slot_view(local), self._digests[g])
        return (g, b, slot, request, time.monotonic())

    def _load(self, requests: list[LoadRequest]) -> list[Reason]:
        assert self._lower is not None
        try:
            answers = list(self._lower.load_into(requests))
        except Exception:
            log.exception("lower tier failed to load %d objects; they will be recomputed", len(requests))
            return [Reason.CORRUPT] * len(requests)
        if len(answers) != len(requests):
            log.error("lower tier answered %d of %d loads; treating them as failed", len(answers), len(requests))
            return [Reason.CORRUPT] * len(requests)
        return [Reason(a) for a in answers]

    def _finish_recovery(self, lease: LeaseSet, g: int, b: int, slot: int, answer: Reason, started: float) -> None:
        """RECOVERING -> SEALED after a verified load (layer 1: the tier filled the whole slot from a
        complete record; layer 2: the record's layout digest is the live one; layer 4: checked at claim),
        else -> FREE and the object is recomputed."""
        t = self._table
        form = self._gform[g]
        if answer == Reason.OK:
            t.move(slot, BlockState.SEALED)
            t.set_verdict(slot, Reason.OK if t.s_ns[slot] == self._ns_id else Reason.STALE_VERSION)
            t.s_recoverable[slot] = True
            t.touch_slot(slot)
            self._counters.event("recovers_ok", form)
            self._counters.recovery_latency(form, time.monotonic() - started)
            if lease.live:
                self._adopt(lease, g, b)
        else:
            t.move(slot, BlockState.FREE)
            self._free_slot(slot, Reason.MISSING)
            self._counters.event("recovers_failed", form)
            self._fail(lease, g, b, answer)

    def _adopt(self, lease: LeaseSet, g: int, b: int) -> None:
        row = lease.rows[b]
        lease.gens[g, b] = self._table.e_gen[g, row]
        lease.routes[g, b] = Route.REUSE
        lease.reasons[g, b] = Reason.OK

    def _fail(self, lease: LeaseSet, g: int, b: int, reason: Reason) -> None:
        lease.routes[g, b] = Route.RECOMPUTE
        lease.reasons[g, b] = reason if reason != Reason.OK else Reason.MISSING

    def _rebuild(self, result: LookupResult) -> None:
        """Re-intersect after recovery; objects evicted since the lookup turn RECOMPUTE `evicted`."""
        lease = result.leases
        t = self._table
        k = result.check_vector.hit_blocks
        current = t.e_gen.take(lease.rows[:k], axis=1)
        moved = (lease.routes[:, :k] == Route.REUSE) & (current != lease.gens[:, :k])
        lease.routes[:, :k][moved] = Route.RECOMPUTE
        lease.reasons[:, :k][moved] = Reason.EVICTED
        result.check_vector = CheckVector.build(self._geometry, lease.routes, lease.reasons)
        # hold the new hit before letting go of the old one: a row kept indexed only by this lease
        # must not be unindexed (and its row reused by another hash) in between
        old_rows, old_slots = lease.held_rows, lease.held_slots
        self._hold(lease, result.check_vector)
        self._let_go(old_rows, old_slots)

    def persist(self, limit: int | None = None) -> int:
        """Store sealed objects the lower tier lacks (write-back); they become recoverable. Returns how many."""
        if self._lower is None:
            return 0
        with self._lock:
            t = self._table
            epoch = self._topology_epoch
            todo = np.flatnonzero((t.s_state == BlockState.SEALED) & ~t.s_recoverable & (t.s_ns == self._ns_id))[:limit]
            work = []
            for slot in todo.tolist():
                g = int(t.s_group[slot])
                t.s_pins[slot] += 1
                key = ObjectKey(self._ns, t.r_hash[t.s_row[slot]], self._names[g], self._forms[g])
                local = slot - int(t.base[g])
                work.append((slot, int(t.s_gen[slot]), key, self._pools[g].slot_view(local), self._digests[g]))
        ok = True
        if work:
            try:
                self._lower.store_many([(key, view, digest) for _, _, key, view, digest in work])
            except Exception:
                log.exception("write-back of %d objects failed; they stay cache-only", len(work))
                ok = False
        done = [(slot, gen, ok) for slot, gen, *_ in work]
        with self._lock:
            if self._topology_epoch != epoch:
                return 0
            t = self._table
            for slot, gen, ok in done:
                if t.s_gen[slot] == gen:
                    t.s_pins[slot] -= 1
                    t.s_recoverable[slot] |= ok
        return sum(ok for *_, ok in done)

    # ------------------------------------------------------------------------------------------
    # introspection

    def counters(self) -> CounterSnapshot:
        """Per-form counters (objects looked up, routes, recompute reasons, recoveries, latency histogram)."""
        with self._lock:
            return msgspec.structs.replace(
                self._counters.snapshot(),
                topology_epoch=self._topology_epoch,
                recovering=self._table.n_recovering,
                recover_queue=self._queued,
                live_leases=len(self._book.leases),
                quota_slots={f.value: int(q) for f, q in zip(self._counters.forms, self._quotas.quota)},
                used_slots={f.value: int(u) for f, u in zip(self._counters.forms, self._quotas.used)},
            )

    def block_state(self, group: str, slot: int) -> CacheBlockState:
        g = self._group(group)
        with self._lock:
            t = self._table
            s = int(t.base[g]) + slot
            ns_id = int(t.s_ns[s])
            namespace = next((ns for ns, i in self._ns_ids.items() if i == ns_id), None) if t.s_state[s] else None
            touch = t.r_touch[t.s_row[s]] if t.s_history[s] else t.s_touch[s]
            return CacheBlockState(
                group,
                slot,
                self._forms[g],
                namespace,
                int(t.s_gen[s]),
                bool(t.s_recoverable[s]),
                int(touch),
                BlockState(int(t.s_state[s])),
                int(t.s_pins[s]),
                int(t.s_leases[s]),
            )

    def audit(self) -> list[str]:
        """Cross-check every invariant of the slot table, index, quotas and leases; returns the violations."""
        with self._lock:
            return self._audit()

    def _audit(self) -> list[str]:
        t = self._table
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
            [state[ids] == BlockState.WRITING, state[ids] == BlockState.RECOVERING, t.s_ns[ids] == self._ns_id],
            [Reason.PARTIAL_BLOCK, IN_FLIGHT, Reason.OK],
            Reason.STALE_VERSION,
        )
        if not rows.size == 0 and not np.array_equal(t.e_verdict[groups, rows], expect.astype(np.int8)):
            bad.append("verdicts disagree with slot states")
        if int((t.e_verdict == Reason.OK).sum()) != int(((state == BlockState.SEALED) & (t.s_ns == self._ns_id)).sum()):
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
        leases = np.zeros_like(t.r_leases)
        slot_leases = np.zeros_like(t.s_leases)
        for lease in self._book.leases.values():
            np.add.at(leases, lease.held_rows, 1)
            for slot, gen in lease.held_slots:
                if t.s_gen[slot] == gen:
                    slot_leases[slot] += 1
        if not np.array_equal(leases[:-1], t.r_leases[:-1]) or not np.array_equal(slot_leases, t.s_leases):
            bad.append("lease counts disagree with live leases")
        unindexed = np.fromiter((h is None for h in t.r_hash), dtype=bool, count=len(t.r_hash))
        if (t.r_leases[:-1][unindexed] > 0).any():
            bad.append("a leased row was unindexed under its lease")
        used = np.zeros_like(self._quotas.used)
        np.add.at(used, np.array(self._gform)[t.s_group[bound]], 1)
        if not np.array_equal(used, self._quotas.used):
            bad.append("quota usage disagrees with occupied slots")
        if int((state == BlockState.RECOVERING).sum()) != t.n_recovering:
            bad.append("recovering count is wrong")
        if self._queued != sum(lease.reserved for lease in self._book.leases.values()):
            bad.append("the recovery queue's reservations disagree with live leases")
        if any(p.address % POOL_ALIGNMENT for p in self._pools):
            bad.append("a pool lost its alignment")
        return bad

    def _group(self, name: str) -> int:
        g = self._group_ix.get(name)
        if g is None:
            raise BadKey(f"profile {self._profile.name} has no group {name!r} (groups: {', '.join(self._names)})")
        return g

    def close(self) -> None:
        """Release the pools' file descriptors (the tensors stay valid while referenced)."""
        with self._lock:
            for pool in self._pools:
                pool.close()
