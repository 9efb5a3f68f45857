"""CacheManager: the GPU-resident cache of one profile: pools, lookups with leases, writes, recovery.

One re-entrant lock guards all state. Lookups run under it (including the lower tier's `has`,
an index probe); bulk I/O (`load_into`, `store`) runs outside it on slots that are RECOVERING or
pinned, so no one else can touch them. Pools are allocated once; `resize` is refused outside
`recompile_window()`.

The manager is the facade: the slot space (pools, table, allocation) is `slots.SlotSpace`, the
per-form rules are the coordinator's, the offload path is `writes.Writes`, recovery and
write-back are `recovery.Recovery`, the invariant check is `invariants.invariant_violations`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import msgspec
import numpy as np
import torch

from kvtier.core.checkvector import CheckVector
from kvtier.core.errors import VersionError
from kvtier.core.forms import CacheForm, Reason, Route
from kvtier.core.profile import ModelProfile
from kvtier.core.tier import LowerTier, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.gpu.admission import AdmissionConfig
from kvtier.gpu.context import NO_ROWS, ManagerContext, PoolLookup
from kvtier.gpu.counters import CounterSnapshot
from kvtier.gpu.errors import BadKey, StaleHandle, TopologyError
from kvtier.gpu.gentable import GenerationTable
from kvtier.gpu.invariants import invariant_violations
from kvtier.gpu.leases import Handle, LeaseSet, WriteHandle
from kvtier.gpu.pools import Pool
from kvtier.gpu.recovery import Recovery
from kvtier.gpu.states import BlockState, CacheBlockState
from kvtier.gpu.table import IN_FLIGHT
from kvtier.gpu.writeback import PersistOutcome, WriteBack
from kvtier.gpu.writes import Writes

log = logging.getLogger(__name__)


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
        self.device = torch.device(device)
        self._c = ManagerContext(
            profile, device=self.device, lower=lower, cfg=admission or AdmissionConfig(), ttl=lease_ttl_s, clock=clock
        )
        self._window_depth = 0
        self._writes = Writes(self._c)
        self._recovery = Recovery(self._c)
        self._write_back = WriteBack(self._c)
        self._c.build(budgets_bytes)

    # ------------------------------------------------------------------------------------------
    # topology

    @contextlib.contextmanager
    def recompile_window(self) -> Iterator[CacheManager]:
        """The only place pool addresses may change; holds the manager for its duration."""
        with self._c.lock:
            self._window_depth += 1
            try:
                yield self
            finally:
                self._window_depth -= 1

    def resize(self, budgets_bytes: Mapping[CacheForm | str, int]) -> None:
        """Reallocate every pool from new budgets: all cached objects, leases and writes are dropped."""
        with self._c.lock:
            if self._window_depth == 0:
                raise TopologyError(
                    "pool addresses change only inside `with manager.recompile_window():` (recapture CUDA graphs there)"
                )
            for lease in self._c.book.leases.values():
                lease.live = False
                lease.reserved = 0  # (a recovery in flight gives its places back when it ends: none are left)
            self._c.book.clear()
            self._c.queued = 0
            if (old := self._c.build(budgets_bytes)) is not None:  # a resize always replaces a slot space
                old.close()
            self._c.topology_epoch += 1
            self._c.cond.notify_all()

    @property
    def topology_epoch(self) -> int:
        return self._c.topology_epoch

    def pool_addresses(self) -> dict[str, int]:
        """Base address of every group's pool (unchanged between recompile windows)."""
        return {p.group: p.address for p in self._c.pools}

    def pools(self) -> tuple[Pool, ...]:
        """The pools: aligned uint8 tensors, slot stride and size, and (cpu) the memfd to map them by."""
        return self._c.pools

    def generation_table(self) -> tuple[GenerationTable, tuple[int, ...]]:
        """The shared slot generations, and where each group's pool starts in it (clients re-validate reads)."""
        return self._c.space.generations, tuple(int(b) for b in self._c.table.base)

    # ------------------------------------------------------------------------------------------
    # versions

    def set_version(self, version: VersionKey) -> bytes:
        """Make `version` live (hot update): objects of other namespaces turn stale_version and go first."""
        with self._c.lock:
            if version.namespace != self._c.ns:
                self._c.use_version(version)
                self._c.table.restamp(self._c.ns_id)
            return self._c.ns

    @property
    def namespace(self) -> bytes:
        return self._c.ns

    @property
    def profile(self) -> ModelProfile:
        return self._c.profile

    def layout_digest(self, group: str) -> bytes:
        """The layout digest (kernel ABI included) a writer of `group` must name."""
        return self._c.digests[self._c.group(group)]

    # ------------------------------------------------------------------------------------------
    # lookup

    def lookup(
        self, block_hashes: Sequence[bytes], *, owner: Hashable = None, namespace: bytes | None = None
    ) -> PoolLookup:
        """Route every object of the request's chained block hashes; lease the REUSE ones of the hit."""
        if namespace is not None and namespace != self._c.ns:
            raise VersionError(
                f"this cache serves namespace {self._c.ns.hex()}, not {namespace.hex()}; "
                "recompute block hashes with the live version key"
            )
        n = len(block_hashes)
        with self._c.lock:
            t = self._c.table
            now = self._c.clock()
            self._c.expire(now)
            rows = np.fromiter(map(t.index.get, block_hashes, itertools.repeat(t.sentinel)), dtype=np.intp, count=n)
            reasons = t.e_verdict.take(rows, axis=1)
            routes = (reasons != 0).view(np.int8)  # verdict OK -> REUSE (0), anything else -> RECOMPUTE (2)
            routes += routes  # (np.minimum / <<= with a Python scalar take numpy's slow casting path)
            cv = CheckVector.build(self._c.geometry, routes, reasons)
            recovering = False
            if self._c.lower is not None and (cv.hit_blocks < n or t.n_recovering):
                # the resident hit is short: ask the lower tier about what could extend it
                if t.n_recovering:
                    inflight = reasons == IN_FLIGHT
                    routes[inflight] = Route.RECOVER
                    reasons[inflight] = Reason.OK
                asked = [0]

                def ask(gs: np.ndarray, bs: np.ndarray) -> np.ndarray:
                    asked[0] += len(gs)
                    return self._ask_lower(block_hashes, gs, bs)

                room = max(0, self._c.cfg.max_recover_queue - self._c.queued - t.n_recovering)
                squeezed = self._c.coordinator.find(routes, reasons, ask, room)
                recovering = bool(asked[0]) or bool(t.n_recovering)
                if recovering:
                    cv = CheckVector.build(self._c.geometry, routes, reasons)
            n_recover = 0
            if recovering:
                cv, n_recover = self._admit_recoveries(cv, routes, reasons, squeezed)
            k = cv.hit_blocks
            lease = LeaseSet(
                lease_id=self._c.book.next_id(),
                owner=owner,
                namespace=self._c.ns,
                expires_at=now + self._c.ttl,
                block_hashes=tuple(block_hashes) if recovering else (),
                rows=rows,
                gens=t.e_gen.take(rows[:k], axis=1),
                routes=routes,
                reasons=reasons,
                held_rows=NO_ROWS,
                held_slots=[],
                reserved=n_recover,
            )
            self._c.queued += n_recover
            self._c.hold(lease, cv)
            self._c.counters.record_lookup(cv.routes, cv.reasons)
            self._c.book.add_lease(lease)
        return PoolLookup(cv, lease)

    def explain(self, block_hashes: Sequence[bytes]) -> tuple[CheckVector, CheckVector]:
        """What each group has of each block, and the hit that allows: `kvtier explain`'s answer. Read-only: no
        lease, no recovery queued, nothing counted. `raw` routes every object on its own (REUSE resident, RECOVER
        loadable from the lower tier, RECOMPUTE with the reason); `final` is their intersection, as a lookup
        builds it (without the recovery queue's cap)."""
        c = self._c
        with c.lock:
            t = c.table
            c.expire(c.clock())
            rows = np.fromiter(
                map(t.index.get, block_hashes, itertools.repeat(t.sentinel)), dtype=np.intp, count=len(block_hashes)
            )
            reasons = t.e_verdict.take(rows, axis=1).astype(np.int8)
        inflight = reasons == IN_FLIGHT
        reasons[inflight] = Reason.OK
        routes = np.where(reasons == Reason.OK, np.int8(Route.REUSE), np.int8(Route.RECOMPUTE)).astype(np.int8)
        routes[inflight] = Route.RECOVER
        gs, bs = np.nonzero(routes == Route.RECOMPUTE)
        if c.lower is not None and gs.size:
            answers = self._ask_lower(block_hashes, gs, bs)
            found = answers == Reason.OK
            routes[gs[found], bs[found]] = Route.RECOVER
            # the lower tier's reason says more (evicted, corrupt) than the pool's `missing`
            lower_says = answers != Reason.MISSING
            reasons[gs[lower_says], bs[lower_says]] = answers[lower_says]
        final = CheckVector.build(c.geometry, routes, reasons)
        raw = CheckVector(
            final.hash_block_tokens, final.group_names, final.group_forms, routes, reasons, final.hit_blocks
        )
        return raw, final

    def _ask_lower(self, block_hashes: Sequence[bytes], gs: np.ndarray, bs: np.ndarray) -> np.ndarray:
        """The lower tier's `has` for objects (gs[i], bs[i]); any failure of the tier reads as missing."""
        assert self._c.lower is not None
        ns, names, forms = self._c.ns, self._c.names, self._c.forms
        try:
            keys = [ObjectKey(ns, block_hashes[b], names[g], forms[g]) for g, b in zip(gs.tolist(), bs.tolist())]
        except ValueError as exc:
            raise BadKey(
                f"block hashes must be 16-byte digests ({exc}); hash blocks with kvtier.core.block_hashes"
            ) from None
        missing = np.full(len(keys), Reason.MISSING, dtype=np.int8)
        try:
            answers = np.fromiter(self._c.lower.has(keys, [self._c.digests[g] for g in gs.tolist()]), dtype=np.int8)
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
        room = max(0, self._c.cfg.max_recover_queue - self._c.queued - self._c.table.n_recovering)
        if wanted <= room and not squeezed:
            return cv, wanted
        self._c.coordinator.admit(routes, reasons, cv.hit_blocks, room)
        cv = CheckVector.build(self._c.geometry, routes, reasons)
        return cv, int(np.count_nonzero(cv.routes == Route.RECOVER))

    # ------------------------------------------------------------------------------------------
    # leases

    def handle(self, result: PoolLookup, group: str, block: int) -> Handle:
        """The handle of one REUSE object of a lookup (raises StaleHandle if it has gone since)."""
        lease = result.leases
        g = self._c.group(group)
        cv = result.check_vector
        if not 0 <= block < cv.hit_blocks or cv.routes[g, block] != Route.REUSE:
            raise BadKey(
                f"{group} block {block} is not REUSE in this lookup; "
                "read only the objects the check vector routes REUSE"
            )
        with self._c.lock:
            self._c.expire(self._c.clock())
            self._c.require_live(lease)
            slot = int(self._c.table.e_slot[g, lease.rows[block]])
            gen = int(lease.gens[g, block])
            if slot < 0 or self._c.table.s_gen[slot] != gen:
                raise StaleHandle(f"{group} block {block} was evicted after the lookup; look the prefix up again")
        local = slot - int(self._c.table.base[g])
        pool = self._c.pools[g]
        return Handle(
            lease.lease_id,
            group,
            block,
            local,
            gen,
            self._c.forms[g],
            lease.namespace,
            local * pool.slot_stride,
            pool.slot_nbytes,
        )

    def handles(self, result: PoolLookup) -> list[Handle]:
        """Handles of every REUSE object of a lookup, block-major."""
        slots, gens = self.grid(result)
        lease = result.leases
        out = []
        for b, g in np.argwhere(slots.T >= 0).tolist():
            pool = self._c.pools[g]
            local = int(slots[g, b])
            out.append(
                Handle(
                    lease.lease_id,
                    self._c.names[g],
                    b,
                    local,
                    int(gens[g, b]),
                    self._c.forms[g],
                    lease.namespace,
                    local * pool.slot_stride,
                    pool.slot_nbytes,
                )
            )
        return out

    def grid(self, result: PoolLookup) -> tuple[np.ndarray, np.ndarray]:
        """Pool-local slot and generation of every REUSE object of a lookup, as (groups, blocks) int64 arrays,
        -1 elsewhere; what `handles` holds, in a few array operations (a restore's reply carries thousands).
        Raises StaleHandle if any of them was evicted since the lookup."""
        lease = result.leases
        k = result.check_vector.hit_blocks
        gs, bs = np.nonzero(result.check_vector.routes[:, :k] == Route.REUSE)
        c = self._c
        with c.lock:
            c.expire(c.clock())
            c.require_live(lease)
            slots = c.table.e_slot[gs, lease.rows[bs]]
            gens = lease.gens[gs, bs]
            stale = slots < 0
            stale[~stale] = c.table.s_gen[slots[~stale]] != gens[~stale]
            if stale.any():
                i = int(np.argmax(stale))
                raise StaleHandle(
                    f"{c.names[gs[i]]} block {bs[i]} was evicted after the lookup; look the prefix up again"
                )
            local = slots - c.table.base[gs]
        shape = result.check_vector.routes.shape
        out_slots = np.full(shape, -1, dtype=np.int64)
        out_gens = np.full(shape, -1, dtype=np.int64)
        out_slots[gs, bs] = local
        out_gens[gs, bs] = gens
        return out_slots, out_gens

    def read(self, handle: Handle, *, copy: bool = False) -> torch.Tensor:
        """The object's bytes (uint8): a view of the slot, or with copy=True a copy taken while it is known good."""
        with self._c.lock:
            self._check_handle(handle)
            view = self._c.pools[self._c.group_ix[handle.group]].slot_view(handle.slot)
            return view.clone() if copy else view

    def valid(self, handle: Handle) -> bool:
        """Whether a handle still names its object (check after using a zero-copy view)."""
        try:
            with self._c.lock:
                self._check_handle(handle)
        except StaleHandle:
            return False
        return True

    def _check_handle(self, handle: Handle) -> None:
        lease = self._c.book.leases.get(handle.lease_id)
        now = self._c.clock()
        if lease is not None and lease.expires_at <= now:
            self._c.expire(now)
        if lease is None or not lease.live:
            raise StaleHandle("the lease was released or expired; look the prefix up again")
        g = self._c.group_ix[handle.group]
        slot = int(self._c.table.base[g]) + handle.slot
        if self._c.table.s_gen[slot] != handle.generation or self._c.table.s_state[slot] != BlockState.SEALED:
            raise StaleHandle(
                f"{handle.group} block {handle.block} was evicted (generation moved); recompute or look up again"
            )

    def release(self, *items: PoolLookup | LeaseSet | Iterable[PoolLookup | LeaseSet]) -> int:
        """Give back leases (idempotent); returns how many were still live."""
        flat: list[PoolLookup | LeaseSet] = []
        for item in items:
            flat.extend([item] if isinstance(item, (PoolLookup, LeaseSet)) else item)
        n = 0
        with self._c.lock:
            for item in flat:
                lease = _lease_of(item)
                if lease.live:
                    self._c.release_lease(lease)
                    self._c.counters.totals["leases_released"] += 1
                    n += 1
        return n

    def renew_owner(self, owner: Hashable) -> int:
        """Push back the expiry of every lease and write of a client that is still alive (its heartbeat);
        returns how many it holds. Leases that already expired stay gone (their readers get StaleHandle)."""
        with self._c.lock:
            now = self._c.clock()
            self._c.expire(now)
            return self._c.book.renew(owner, now + self._c.ttl)

    def release_owner(self, owner: Hashable) -> int:
        """Release every lease and abort every write of an owner (a client that went away)."""
        n = 0
        with self._c.lock:
            for ident in self._c.book.of_owner(owner):
                lease = self._c.book.leases.get(ident)
                if lease is not None:
                    self._c.release_lease(lease)
                    n += 1
                elif ident in self._c.book.writes:
                    self._c.abort_write(self._c.book.writes[ident][0])
                    n += 1
        return n

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
        with self._c.lock:
            if handle.write_id not in self._c.book.writes:
                return False
            self._c.abort_write(handle)
            return True

    def write_block(
        self, key: ObjectKey, payload: torch.Tensor, *, layout_digest: bytes, owner: Hashable = None
    ) -> bool:
        """begin_write + copy + seal for in-process writers; False if the object was already cached."""
        return self._writes.write_block(key, payload, layout_digest, owner)

    # ------------------------------------------------------------------------------------------
    # eviction and pins

    def evict(self, keys: Iterable[ObjectKey]) -> int:
        """Evict sealed, unpinned objects now (leaseholders then get StaleHandle); returns how many went."""
        n = 0
        with self._c.lock:
            for key in keys:
                slot = self._c.slot_of(key)
                if slot >= 0 and self._c.space.evict_unpinned(slot):
                    n += 1
        return n

    def pin(self, keys: Iterable[ObjectKey]) -> int:
        """Protect resident sealed objects from every eviction until unpinned; returns how many were pinned."""
        return self._each_sealed(keys, self._c.table.pin)

    def unpin(self, keys: Iterable[ObjectKey]) -> int:
        return self._each_sealed(keys, self._c.table.unpin)

    def _each_sealed(self, keys: Iterable[ObjectKey], op: Callable[[int], bool]) -> int:
        """Apply `op` to the slot of every resident sealed object; how many it applied to."""
        n = 0
        with self._c.lock:
            t = self._c.table
            for key in keys:
                slot = self._c.slot_of(key)
                if slot >= 0 and t.s_state[slot] == BlockState.SEALED and op(slot):
                    n += 1
        return n

    # ------------------------------------------------------------------------------------------
    # lower tier: recovery and write-back

    def recover(self, result: PoolLookup, *, timeout_s: float | None = None) -> PoolLookup:
        """Load the RECOVER objects of a lookup into slots (at most `max_recovering` at once across the
        manager; the rest wait), verify them, and lease them as REUSE; failures, and REUSE objects evicted
        since the lookup, become RECOMPUTE and the hit is recomputed. Returns the same result with its
        check vector updated."""
        return self._recovery.recover(result, timeout_s)

    def persist(self, limit: int | None = None, *, skip: Iterable[CacheForm] = ()) -> int:
        """Store sealed objects the lower tier lacks (write-back), up to `limit` per form, forms in `skip`
        left out; they become recoverable. Returns how many (see `persist_batch` for what failed)."""
        return self.persist_batch(limit, skip=skip).stored

    def persist_batch(
        self,
        limit: int | None = None,
        *,
        skip: Iterable[CacheForm] = (),
        only: Sequence[ObjectKey] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> PersistOutcome:
        """`persist`, with the forms whose batch the lower tier refused and why; with `only`, just those objects
        (the ones of them sealed and not yet in the lower tier). `until`: asked after each batch; True ends the
        call there, its limit not reached (the write-back serves a waiting durable offload, then calls again)."""
        if self._c.lower is None:
            return PersistOutcome()
        return self._write_back.persist(limit, frozenset(skip), only, until)

    def write_back_backlog(self) -> dict[CacheForm, int]:
        """Sealed objects of the live namespace the lower tier does not have yet, per form."""
        with self._c.lock:
            per_group = self._write_back.backlog()
        out: dict[CacheForm, int] = {}
        for form, n in zip(self._c.forms, per_group.tolist()):
            out[form] = out.get(form, 0) + n
        return out

    def residence(self, keys: Sequence[ObjectKey]) -> list[BlockState | None]:
        """Where each object is in the pools now: its slot's state, or None when no slot holds it."""
        with self._c.lock:
            t = self._c.table
            out: list[BlockState | None] = []
            for key in keys:
                slot = self._c.slot_of(key)
                out.append(BlockState(int(t.s_state[slot])) if slot >= 0 else None)
            return out

    # ------------------------------------------------------------------------------------------
    # introspection

    def counters(self) -> CounterSnapshot:
        """Per-form counters (objects looked up, routes, recompute reasons, recoveries, latency histogram)."""
        with self._c.lock:
            return msgspec.structs.replace(
                self._c.counters.snapshot(),
                topology_epoch=self._c.topology_epoch,
                recovering=self._c.table.n_recovering,
                recover_queue=self._c.queued,
                live_leases=len(self._c.book.leases),
                quota_slots={f.value: int(q) for f, q in zip(self._c.counters.forms, self._c.quotas.quota)},
                used_slots={f.value: int(u) for f, u in zip(self._c.counters.forms, self._c.quotas.used)},
            )

    def block_state(self, group: str, slot: int) -> CacheBlockState:
        g = self._c.group(group)
        with self._c.lock:
            t = self._c.table
            s = int(t.base[g]) + slot
            ns_id = int(t.s_ns[s])
            namespace = next((ns for ns, i in self._c.ns_ids.items() if i == ns_id), None) if t.s_state[s] else None
            touch = t.r_touch[t.s_row[s]] if t.s_history[s] else t.s_touch[s]
            return CacheBlockState(
                group,
                slot,
                self._c.forms[g],
                namespace,
                int(t.s_gen[s]),
                bool(t.s_recoverable[s]),
                int(touch),
                BlockState(int(t.s_state[s])),
                int(t.s_pins[s]),
                int(t.s_leases[s]),
            )

    def invariant_violations(self) -> list[str]:
        """Cross-check every invariant of the slot table, index, quotas and leases; returns the violations."""
        with self._c.lock:
            return invariant_violations(self._c.space, self._c.book.leases.values(), self._c.ns_id, self._c.queued)

    def close(self) -> None:
        """Release the pools' file descriptors (the tensors stay valid while referenced)."""
        with self._c.lock:
            self._c.space.close()
