"""CacheManager: the GPU-resident cache of one profile: pools, lookups with leases, writes, recovery.

One re-entrant lock guards all state. Lookups run under it (including the lower tier's `has`,
an index probe); bulk I/O (`load_into`, `store`) runs outside it on slots that are RECOVERING or
pinned, so no one else can touch them. Pools are allocated once; `resize` is refused outside
`recompile_window()`.

The manager is the facade: the slot space (pools, table, allocation) is `slots.SlotSpace`, the
per-form rules are the coordinator's, the offload path is `writes.Writes`, recovery and
write-back are `recovery.Recovery`, the invariant audit is `audit.audit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import msgspec
import numpy as np
import torch

from kvtier.core.checkvector import CheckVector, HitGeometry
from kvtier.core.errors import VersionError
from kvtier.core.forms import CacheForm, Reason, Route
from kvtier.core.profile import ModelProfile
from kvtier.core.tier import LowerTier, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.gpu.admission import AdmissionConfig
from kvtier.gpu.audit import audit
from kvtier.gpu.coordinator import Coordinator
from kvtier.gpu.counters import Counters, CounterSnapshot
from kvtier.gpu.errors import BadKey, StaleHandle, TopologyError
from kvtier.gpu.leases import Handle, LeaseBook, LeaseSet, WriteHandle
from kvtier.gpu.pools import Pool
from kvtier.gpu.recovery import Recovery
from kvtier.gpu.slots import SlotSpace
from kvtier.gpu.states import BlockState, CacheBlockState
from kvtier.gpu.table import IN_FLIGHT
from kvtier.gpu.writes import Writes

log = logging.getLogger(__name__)
_NO_ROWS = np.zeros(0, dtype=np.intp)


@dataclasses.dataclass(slots=True)
class PoolLookup:
    """What a lookup of the pools answers: the check vector and the lease that keeps its REUSE objects
    readable (the daemon's client sees its own `kvtier.client.LookupResult`)."""

    check_vector: CheckVector
    leases: LeaseSet


def _lease_of(item: PoolLookup | LeaseSet) -> LeaseSet:
    return item.leases if isinstance(item, PoolLookup) else item


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
        self._coordinator = Coordinator(profile, self._cfg.state_probe_boundaries)
        self._counters = Counters(self._forms)
        self._ns_ids: dict[bytes, int] = {}
        self._profile = profile
        self._geometry = HitGeometry.of(profile)
        self._use_version(profile.version)
        self._book = LeaseBook()
        self._queued = 0
        self._window_depth = 0
        self._topology_epoch = 0
        self._writes = Writes(self)
        self._recovery = Recovery(self)
        self._build(budgets_bytes)

    # ------------------------------------------------------------------------------------------
    # topology

    def _build(self, budgets_bytes: Mapping[CacheForm | str, int]) -> None:
        budgets = {CacheForm(k): int(v) for k, v in budgets_bytes.items()}
        self._space = SlotSpace(self._profile, budgets, self.device, self._cfg, self._counters)
        # the slot space's parts, named once: every path below reads them
        self._pools = self._space.pools
        self._table = self._space.table
        self._quotas = self._space.quotas
        self._gform = self._space.gform

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
            old = self._space
            self._build(budgets_bytes)
            old.close()
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
                self._table.restamp(self._ns_id)
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
    ) -> PoolLookup:
        """Route every object of the request's chained block hashes; lease the REUSE ones of the hit."""
        if namespace is not None and namespace != self._ns:
            raise VersionError(
                f"this cache serves namespace {self._ns.hex()}, not {namespace.hex()}; "
                "recompute block hashes with the live version key"
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
        return PoolLookup(cv, lease)

    def explain(self, block_hashes: Sequence[bytes]) -> tuple[CheckVector, CheckVector]:
        """What each group has of each block, and the hit that allows: `kvtier explain`'s answer. Read-only: no
        lease, no recovery queued, nothing counted. `raw` routes every object on its own (REUSE resident, RECOVER
        loadable from the lower tier, RECOMPUTE with the reason); `final` is their intersection, as a lookup
        builds it (without the recovery queue's cap)."""
        with self._lock:
            t = self._table
            self._expire(self._clock())
            rows = np.fromiter(
                map(t.index.get, block_hashes, itertools.repeat(t.sentinel)), dtype=np.intp, count=len(block_hashes)
            )
            reasons = t.e_verdict.take(rows, axis=1).astype(np.int8)
        inflight = reasons == IN_FLIGHT
        reasons[inflight] = Reason.OK
        routes = np.where(reasons == Reason.OK, np.int8(Route.REUSE), np.int8(Route.RECOMPUTE)).astype(np.int8)
        routes[inflight] = Route.RECOVER
        gs, bs = np.nonzero(routes == Route.RECOMPUTE)
        if self._lower is not None and gs.size:
            answers = self._ask_lower(block_hashes, gs, bs)
            found = answers == Reason.OK
            routes[gs[found], bs[found]] = Route.RECOVER
            # the lower tier's reason says more (evicted, corrupt) than the pool's `missing`
            lower_says = answers != Reason.MISSING
            reasons[gs[lower_says], bs[lower_says]] = answers[lower_says]
        final = CheckVector.build(self._geometry, routes, reasons)
        raw = CheckVector(
            final.hash_block_tokens, final.group_names, final.group_forms, routes, reasons, final.hit_blocks
        )
        return raw, final

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
        self._coordinator.admit(routes, reasons, cv.hit_blocks, room)
        cv = CheckVector.build(self._geometry, routes, reasons)
        return cv, int(np.count_nonzero(cv.routes == Route.RECOVER))

    def _hold(self, lease: LeaseSet, cv: CheckVector) -> None:
        """Protect the hit: history objects of its rows, state objects of its window, from pressure eviction."""
        k = cv.hit_blocks
        held = lease.rows[:k].copy()
        lease.held_slots = self._coordinator.hold(self._table, lease.rows, cv.routes, k)
        lease.held_rows = held

    def _unhold(self, lease: LeaseSet) -> None:
        self._table.let_go(lease.held_rows, lease.held_slots)
        lease.held_rows = _NO_ROWS
        lease.held_slots = []

    # ------------------------------------------------------------------------------------------
    # leases

    def handle(self, result: PoolLookup, group: str, block: int) -> Handle:
        """The handle of one REUSE object of a lookup (raises StaleHandle if it has gone since)."""
        lease = result.leases
        g = self._group(group)
        cv = result.check_vector
        if not 0 <= block < cv.hit_blocks or cv.routes[g, block] != Route.REUSE:
            raise BadKey(
                f"{group} block {block} is not REUSE in this lookup; "
                "read only the objects the check vector routes REUSE"
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

    def handles(self, result: PoolLookup) -> list[Handle]:
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

    def release(self, *items: PoolLookup | LeaseSet | Iterable[PoolLookup | LeaseSet]) -> int:
        """Give back leases (idempotent); returns how many were still live."""
        flat: list[PoolLookup | LeaseSet] = []
        for item in items:
            flat.extend([item] if isinstance(item, (PoolLookup, LeaseSet)) else item)
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
                    self._writes.abort(self._book.writes[ident][0])
                    n += 1
        return n

    def _release_lease(self, lease: LeaseSet) -> None:
        lease.live = False
        self._unhold(lease)
        self._book.drop(lease.lease_id)
        self._unreserve(lease)

    def _unreserve(self, lease: LeaseSet) -> None:
        """Give the lease's places in the recovery queue back (a recovery ended, or the lease did)."""
        self._queued -= lease.reserved
        lease.reserved = 0
        self._cond.notify_all()

    def _expire(self, now: float) -> None:
        for ident in self._book.due(now):
            lease = self._book.leases.get(ident)
            if lease is not None:
                self._release_lease(lease)
                self._counters.totals["leases_expired"] += 1
                log.debug("lease %d of %r expired after %.1f s without release", ident, lease.owner, self._ttl)
            else:
                self._writes.abort(self._book.writes[ident][0])
                self._counters.totals["writes_expired"] += 1

    # ------------------------------------------------------------------------------------------
    # writes (the offload path)

    def begin_write(self, key: ObjectKey, *, layout_digest: bytes, owner: Hashable = None) -> WriteHandle | None:
        """Reserve a slot for a new object; None if it is already cached or being filled by someone else."""
        return self._writes.begin(key, layout_digest, owner)

    def seal(self, handle: WriteHandle, *, written_bytes: int) -> None:
        """Seal a written object: it must be whole (written_bytes == nbytes), else it is dropped."""
        self._writes.seal(handle, written_bytes)

    def abort(self, handle: WriteHandle) -> bool:
        """Drop an unsealed write (idempotent); returns whether it was still open."""
        with self._lock:
            if handle.write_id not in self._book.writes:
                return False
            self._writes.abort(handle)
            return True

    def write_block(
        self, key: ObjectKey, payload: torch.Tensor, *, layout_digest: bytes, owner: Hashable = None
    ) -> bool:
        """begin_write + copy + seal for in-process writers; False if the object was already cached."""
        return self._writes.write_block(key, payload, layout_digest, owner)

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

    # ------------------------------------------------------------------------------------------
    # eviction and pins

    def evict(self, keys: Iterable[ObjectKey]) -> int:
        """Evict sealed, unpinned objects now (leaseholders then get StaleHandle); returns how many went."""
        n = 0
        with self._lock:
            for key in keys:
                slot = self._slot_of(key)
                if slot >= 0 and self._space.evict_unpinned(slot):
                    n += 1
        return n

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        """Protect resident sealed objects from every eviction until unpinned; returns how many were pinned."""
        return self._each_sealed(keys, self._table.pin)

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        return self._each_sealed(keys, self._table.unpin)

    def _each_sealed(self, keys: Iterable[ObjectKey], op: Callable[[int], bool]) -> int:
        """Apply `op` to the slot of every resident sealed object; how many it applied to."""
        n = 0
        with self._lock:
            t = self._table
            for key in keys:
                slot = self._slot_of(key)
                if slot >= 0 and t.s_state[slot] == BlockState.SEALED and op(slot):
                    n += 1
        return n

    def _slot_of(self, key: ObjectKey) -> int:
        g = self._check_key(key)
        row = self._table.index.get(key.block_hash)
        return -1 if row is None else int(self._table.e_slot[g, row])

    # ------------------------------------------------------------------------------------------
    # lower tier: recovery and write-back

    def recover(self, result: PoolLookup, *, timeout_s: float | None = None) -> PoolLookup:
        """Load the RECOVER objects of a lookup into slots (at most `max_recovering` at once across the
        manager; the rest wait), verify them, and lease them as REUSE; failures, and REUSE objects evicted
        since the lookup, become RECOMPUTE and the hit is recomputed. Returns the same result with its
        check vector updated."""
        return self._recovery.recover(result, timeout_s)

    def persist(self, limit: int | None = None) -> int:
        """Store sealed objects the lower tier lacks (write-back); they become recoverable. Returns how many."""
        if self._lower is None:
            return 0
        return self._recovery.persist(limit)

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
            return audit(self._space, self._book.leases.values(), self._ns_id, self._queued)

    def _group(self, name: str) -> int:
        g = self._group_ix.get(name)
        if g is None:
            raise BadKey(f"profile {self._profile.name} has no group {name!r} (groups: {', '.join(self._names)})")
        return g

    def close(self) -> None:
        """Release the pools' file descriptors (the tensors stay valid while referenced)."""
        with self._lock:
            self._space.close()
