"""The daemon's backend: one `kvtier.gpu.CacheManager` per served profile over one `kvtier.store.DiskStore`.

The store, the engines' tier ops and the stats are ready when the constructor returns; the pools are
allocated behind them (`kvtier.daemon.pool_start`, started once the daemon listens), and a config with no
profiles allocates none at all (an engine-only node). An attach waits for the pools.

Requests arrive from the server as protocol structs and leave as replies. Lookups and offloads hand
out *handles* (wire ids) owned by the connection that made them; a connection that goes away has
every handle released, in the manager too (`release_owner`); while it lives, its heartbeat (`renew`)
keeps them. Offloaded objects are acknowledged once sealed in the pool and written to the store by a
background `Persister`; `durable` and `flush` wait for the store commit and say what did not make it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.checkvector import CheckVector, window_blocks
from kvtier.core.config import DaemonConfig
from kvtier.core.errors import ProfileError
from kvtier.core.forms import Route
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.not_durable import NotDurableCause as Cause
from kvtier.core.not_durable import NotDurableCount
from kvtier.core.profile import ModelProfile, load_profile
from kvtier.core.tier import LowerTier, ObjectKey
from kvtier.core.verifier_status import verifier_status
from kvtier.daemon.below_pools import build_lower, close_lower, cluster_doc, cluster_problem
from kvtier.daemon.engine_ops import EngineOps
from kvtier.daemon.events import EventPublisher, start_events, stop_events
from kvtier.daemon.namespaces import Rollout, stale_reply
from kvtier.daemon.persister import Persister
from kvtier.daemon.pool_start import PoolStart
from kvtier.daemon.reader_slots import ReaderSlots
from kvtier.daemon.runtime import Runtime, resolve_device
from kvtier.daemon.session import Session
from kvtier.daemon.startup_phases import PHASES
from kvtier.daemon.stats import backend_stats
from kvtier.daemon.tier_ops import TierOps
from kvtier.daemon.writeback_room import RoomRequests
from kvtier.store import DecisionServer, DiskStore, PutDoc
from kvtier.wire import messages as P
from kvtier.wire.errors import NoPools, OutOfOrder, WrongType
from kvtier.wire.stats import PinStats, StatsDoc

if TYPE_CHECKING:  # the pools' modules (and torch) are loaded behind serving, by the pool thread
    from kvtier.gpu import PoolLookup, WriteHandle

log = logging.getLogger(__name__)
# the longest an attach waits for pools still being allocated before it is refused: below the clients' default
# 60 s call deadline, so a client hears why rather than timing out
ATTACH_WAIT_S = 45.0


def _split_hashes(data: bytes) -> list[bytes]:
    if len(data) % HASH_BYTES:
        raise WrongType(f"hashes must be whole {HASH_BYTES}-byte block hashes, got {len(data)} bytes")
    return [data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


def _wire_cv(cv: CheckVector) -> P.CheckVectorWire:
    return P.CheckVectorWire(**cv.to_wire())


@dataclasses.dataclass(slots=True)
class Held:
    """What a wire handle stands for: a lookup's leases, or an offload's reserved slots."""

    owner: Hashable
    runtime: Runtime
    lookup: PoolLookup | None = None
    writes: list[WriteHandle] = dataclasses.field(default_factory=list)
    expires_at: float = float("inf")
    named: list[ObjectKey] = dataclasses.field(default_factory=list)  # every object an offload names
    refused: frozenset[int] = frozenset()  # indices into `named` that got no slot


class DaemonBackend:
    """What the server calls: attach / lookup / load / release / offload / seal / flush / prewarm, stats, life cycle."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self._closed = False  # first: close() runs on a failed start too (a bad profile, an unusable store)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        # the loads' resources are tensors: taken by the warm-up behind serving (`_warm`), not before listening
        self.store = DiskStore(str(cfg.store.root), cfg.store, writer=True, take_load_resources=False)
        self.runtimes: dict[str, Runtime] = {}  # filled by the pool thread (`_adopt`); the rollout's live map
        self.lower: LowerTier = self.store
        self._start_lock = threading.Lock()  # a reload and the pools' adoption apply the config one at a time
        self.events: EventPublisher | None = None
        try:
            self.events = start_events(cfg.events, self.store)
            self.lower = build_lower(cfg, self.store, self.events)
            profiles: dict[str, ModelProfile] = {}
            for name in cfg.profiles:
                profile = load_profile(name)
                if profile.name in profiles:
                    raise ProfileError(f"profile {profile.name!r} is listed twice", field="profiles")
                codecs = {g.form: cfg.store.codec for g in profile.groups} if cfg.store.codec != "none" else None
                self.store.register_namespace(profile.version, codecs=codecs)
                profiles[profile.name] = profile
                if self.events is not None:
                    self.events.name_groups(profile.version.namespace, [g.name for g in profile.groups])
            self.rollout = Rollout(self.store, cfg.store.codec, self.runtimes, self._new_pools)
            self.rollout.apply(cfg)
        except BaseException:
            self.close()
            raise
        self.pool_start = PoolStart(list(profiles.values()), self._new_pools, self._adopt, warm=self._warm)
        self.persister = Persister(self.rollout.all, cfg.persist_queue_depth)  # a canary's pools join the list
        # The index's changes the verifier decides, and the main loop's documents, are applied on this thread:
        # the daemon is the index's only writer while it runs (kvtier.store.decisions).
        self.decisions = DecisionServer(self.store.root, self.store.apply_decision)
        self.decisions.start()
        self.room = RoomRequests(self.store, self.persister, publish=self._post_doc)
        self.reader_slots = ReaderSlots(self.store)
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._ids = itertools.count(1)
        self._pins: list[tuple[float, int, Runtime, list[ObjectKey]]] = []  # (expiry, seq, runtime, keys) heap
        self._pin_seq = itertools.count()
        self._prewarm_owner = ("prewarm", os.getpid())
        self.tier = TierOps(self.store, cfg.store.codec, lower=self.lower, events=self.events)
        self.engine = EngineOps(self.store, self.lower)

    def start_pools(self, on_change: Callable[[], None]) -> None:
        """Load torch and allocate the pools behind serving (the daemon calls this once it listens); `on_change`
        is called from the pool thread whenever `pools_state` may have changed."""
        self.pool_start.start(on_change)

    def _warm(self) -> None:
        """Behind serving, on the pool thread: torch and the modules of the pools and of loads, then the store's
        load resources, so neither the first load nor the pools' allocation pays them."""
        import torch  # noqa: F401  (the import is the point: seconds of CPU, paid here rather than before listening)

        from kvtier.daemon import durability, staging  # noqa: F401  (a seal's: kvtier.gpu, the staging copy)

        self.store.take_load_resources()

    def _adopt(self, runtimes: list[Runtime]) -> None:
        """The pool thread's pools go live: the profiles' versions and canaries of the config now in force."""
        with self._start_lock:
            self.rollout.add_live(runtimes)
            self.rollout.apply(self.cfg)
        PHASES.mark("pools_ready")

    def pools_state(self) -> str:
        """none (no profiles), waiting / allocating, ready, or failed: <why>."""
        state = self.pool_start.state
        return f"failed: {self.pool_start.error}" if state == "failed" else state

    def _new_pools(self, profile: ModelProfile) -> Runtime:
        """A pool set for `profile` (its live version's at start; a canary's when the first one starts)."""
        from kvtier.gpu import CacheManager  # loaded by now: the pool thread imports the pools' modules first

        cfg = self.cfg
        manager = CacheManager(
            profile,
            budgets_bytes={f.value: cfg.pool.budget_bytes[f.value] for f in {g.form for g in profile.groups}},
            device=self.device,
            lower=self.lower,
            admission=cfg.admission,
            lease_ttl_s=cfg.lease_ttl_s,
        )
        sizes = np.array([g.object_bytes(profile.hash_block_tokens) for g in profile.groups], dtype=np.int64)
        return Runtime(profile.name, profile, manager, sizes)

    # -- handles ------------------------------------------------------------------------------------

    def _runtime(self, session: Session) -> Runtime:
        assert session.runtime is not None
        return session.runtime

    def _add(self, held: Held) -> int:
        with self._lock:
            ident = next(self._ids)
            self._held[ident] = held
            return ident

    def _get(self, session: Session, ident: int, *, lookup: bool) -> Held:
        with self._lock:
            held = self._held.get(ident)
        if held is None or held.owner != session.owner or (held.lookup is not None) != lookup:
            what = "lookup" if lookup else "offload"
            raise OutOfOrder(
                f"no {what} {ident} held by this connection (released, expired, or never made): {what} first"
            )
        return held

    def _pop(self, ident: int) -> Held | None:
        with self._lock:
            return self._held.pop(ident, None)

    # -- ops ----------------------------------------------------------------------------------------

    def _wait_for_pools(self) -> None:
        """An attach maps the pools, so it waits while they allocate; without pools it gets why, in one line."""
        start = self.pool_start
        if start.state == "none":
            raise NoPools(
                f"this daemon serves no kvtier profiles (profiles = [] in {self.cfg.source}): an engine-only node "
                "has no pools; use an engine tier (vLLM, SGLang), or add the profile to `profiles` and restart"
            )
        if not start.wait(ATTACH_WAIT_S):
            raise NoPools(
                f"kvtier serve is still allocating its pools after {ATTACH_WAIT_S:.0f} s: attach again shortly "
                "(`kvtier status` says starting until they are ready)"
            )
        if start.state == "failed":
            raise NoPools(f"the daemon's pools could not be allocated ({start.error}): fix it and restart kvtier serve")

    def attach(self, session: Session, req: P.Attach) -> tuple[P.AttachOk, list[int]]:
        self._wait_for_pools()
        rt = self.rollout.runtime_for(req.profile)
        session.runtime = rt
        infos, fds = rt.pool_infos()
        ok = P.AttachOk(
            rt.name, rt.manager.namespace, rt.profile.hash_block_tokens, self.device, self.cfg.lease_ttl_s, infos
        )
        return ok, fds

    def lookup(self, session: Session, req: P.Lookup) -> P.LookupOk:
        rt = self._runtime(session)
        result = rt.manager.lookup(_split_hashes(req.hashes), owner=session.owner)
        ident = self._add(Held(session.owner, rt, lookup=result))
        slots, gens = rt.grids(result)
        return P.LookupOk(ident, _wire_cv(result.check_vector), slots, gens)

    def load(self, session: Session, req: P.Load) -> P.LoadOk:
        held = self._get(session, req.lookup_id, lookup=True)
        result, rt = held.lookup, held.runtime
        assert result is not None
        started = time.perf_counter()
        before = result.check_vector.routes == Route.RECOVER
        rt.manager.recover(result)
        loaded = before & (result.check_vector.routes == Route.REUSE)
        n_bytes = int((loaded.sum(axis=1) * rt.object_bytes).sum())
        slots, gens = rt.grids(result)
        return P.LoadOk(
            _wire_cv(result.check_vector), slots, gens, int(loaded.sum()), n_bytes, time.perf_counter() - started
        )

    def release(self, session: Session, req: P.Release) -> P.Released:
        with self._lock:
            held = self._held.get(req.handle)
            if held is None or held.owner != session.owner:
                raise OutOfOrder(f"no lookup or offload {req.handle} held by this connection (already released?)")
            del self._held[req.handle]
        return P.Released(self._release(held))

    def _release(self, held: Held) -> int:
        manager = held.runtime.manager
        if held.lookup is not None:
            return manager.release(held.lookup)
        return sum(manager.abort(w) for w in held.writes)

    def offload(self, session: Session, req: P.Offload) -> P.OffloadOk:
        from kvtier.gpu import AdmissionRefused  # an attached session: the pools' modules are loaded

        rt = self._runtime(session)
        hashes = _split_hashes(req.hashes)
        if len(req.groups) != len(req.blocks):
            raise WrongType(f"offload names {len(req.groups)} groups but {len(req.blocks)} block lists")
        groups = {g.name: g for g in rt.profile.groups}
        manager = rt.manager
        slots: list[list[int]] = []
        writes: list[WriteHandle] = []
        named: list[ObjectKey] = []
        refused_at: list[int] = []
        try:
            for name, blocks in zip(req.groups, req.blocks):
                group = groups.get(name)
                if group is None:
                    raise WrongType(f"profile {rt.name} has no cache group {name!r}")
                if len(set(blocks)) != len(blocks) or any(not 0 <= b < len(hashes) for b in blocks):
                    raise WrongType(f"{name}: block indices must be distinct and within the {len(hashes)} hashes sent")
                digest = manager.layout_digest(name)
                row: list[int] = []
                for b in blocks:
                    key = ObjectKey(manager.namespace, hashes[b], name, group.form)
                    named.append(key)
                    try:
                        handle = manager.begin_write(key, layout_digest=digest, owner=session.owner)
                    except AdmissionRefused:
                        handle = None
                        refused_at.append(len(named) - 1)
                    if handle is not None:
                        writes.append(handle)
                    row.append(handle.slot if handle is not None else -1)
                slots.append(row)
        except BaseException:
            for w in writes:
                manager.abort(w)
            raise
        expires = time.monotonic() + self.cfg.lease_ttl_s
        ident = self._add(
            Held(session.owner, rt, writes=writes, expires_at=expires, named=named, refused=frozenset(refused_at))
        )
        return P.OffloadOk(ident, slots, len(refused_at))

    def seal(self, session: Session, req: P.Seal, fds: Sequence[int] = ()) -> P.SealOk:
        """Seal an offload's objects, each only if whole by the bytes that really arrived (on cpu: copied from
        the client's frozen staging region); with `durable`, count what the store has committed."""
        held = self._get(session, req.offload_id, lookup=False)
        self._pop(req.offload_id)
        manager = held.runtime.manager
        sealed = 0
        try:
            if len(req.written) != len(held.writes):
                raise WrongType(f"seal names {len(req.written)} written sizes for {len(held.writes)} reserved objects")
            for w, n in zip(held.writes, self._fill(held, req.written, fds)):
                manager.seal(w, written_bytes=n)
                sealed += 1
        except BaseException:
            for w in held.writes[sealed:]:
                manager.abort(w)
            raise
        self.persister.sealed(sealed, self.cfg.shutdown_timeout_s)
        if not req.durable:
            return P.SealOk(sealed, False)
        from kvtier.daemon.durability import make_durable  # it reads the pools' block states (kvtier.gpu)

        d = make_durable(self.store, self.persister, held.runtime, held.named, held.refused, self.cfg.durable_wait_s)
        if d.not_durable:
            log.warning(
                "durable offload: %d of %d objects not in the store: %s",
                d.not_durable,
                len(held.named),
                "; ".join(map(str, d.why)),
            )
        return P.SealOk(sealed, d.not_durable == 0, d.durable, d.not_durable, d.why)

    def _fill(self, held: Held, written: list[int], fds: Sequence[int]) -> list[int]:
        """The bytes each reserved object really holds. On cpu the client cannot write the pools: its bytes
        arrive in one staging memfd, frozen here and copied into the slots; on cuda it wrote them in place."""
        from kvtier.daemon.staging import StagingError, copy_in, freeze  # torch: loaded with the pools

        pools = held.runtime.manager.pools()
        if not held.writes or pools[0].reader_fd is None:
            return list(written)
        if len(fds) != 1:
            raise StagingError("a cpu offload sends its bytes in one staging memfd along with seal")
        size = freeze(fds[0])
        index = {p.group: i for i, p in enumerate(pools)}
        real: list[int] = []
        offset = 0
        for w, claimed in zip(held.writes, written):
            got = copy_in(fds[0], offset, pools[index[w.key.group]].slot_view(w.slot)) if offset < size else 0
            real.append(min(got, claimed))
            offset += w.nbytes
        return real

    def renew(self, session: Session, req: P.Renew) -> P.Renewed:
        """The client's heartbeat: its leases and reserved writes live on for another TTL."""
        expires = time.monotonic() + self.cfg.lease_ttl_s
        with self._lock:
            for held in self._held.values():
                if held.owner == session.owner and held.lookup is None:
                    held.expires_at = max(held.expires_at, expires)
        return P.Renewed(sum(rt.manager.renew_owner(session.owner) for rt in self.rollout.runtimes()))

    def flush(self, session: Session, req: P.Flush) -> P.FlushOk:
        """Write back everything sealed; what still waits at the end is reported with why (blocked forms)."""
        done, persisted = self.persister.wait_pass(req.timeout_s)
        pending = self.persister.queued
        if not pending:
            return P.FlushOk(persisted, 0)
        if not done:
            late = NotDurableCount(Cause.TIMED_OUT, pending, f"the write-back pass did not finish in {req.timeout_s}s")
            return P.FlushOk(persisted, pending, [late])
        return P.FlushOk(persisted, pending, self.persister.why_waiting())

    def prewarm(self, session: Session, req: P.Prewarm) -> P.PrewarmOk:
        """The longest usable hit, RECOVER objects loaded; every object of it pinned (pool and disk) for ttl_s."""
        if req.ttl_s <= 0:
            raise WrongType(f"ttl_s must be > 0, got {req.ttl_s}")
        rt = self._runtime(session)
        manager = rt.manager
        hashes = _split_hashes(req.hashes)
        started = time.perf_counter()
        result = manager.lookup(hashes, owner=self._prewarm_owner)
        try:
            before = result.check_vector.routes == Route.RECOVER
            manager.recover(result)
            cv = result.check_vector
            loaded = before & (cv.routes == Route.REUSE)
            keys = [
                ObjectKey(manager.namespace, hashes[b], name, form)
                for b, name, form, route, _ in cv.entries()
                if route is Route.REUSE
            ]
            pinned = manager.pin(keys)
            self.lower.pin(keys, req.ttl_s)  # with a cluster: after the promotions of what it loaded
        finally:
            manager.release(result)
        if keys:
            with self._lock:
                heapq.heappush(self._pins, (time.monotonic() + req.ttl_s, next(self._pin_seq), rt, keys))
        n_bytes = int((loaded.sum(axis=1) * rt.object_bytes).sum())
        return P.PrewarmOk(_wire_cv(cv), int(loaded.sum()), n_bytes, pinned, time.perf_counter() - started)

    def explain(self, session: Session, req: P.Explain) -> P.ExplainOk:
        """Per group what the pool and the store hold of the blocks, and the hit they allow; nothing leased."""
        rt = self._runtime(session)
        raw, final = rt.manager.explain(_split_hashes(req.hashes))
        return P.ExplainOk(_wire_cv(raw), _wire_cv(final), window_blocks(rt.profile).tolist())

    def engine_op(self, session: Session, req: P.EngineNamespaces | P.EngineKeys) -> P.Msg:
        """Prewarm and explain for engine namespaces (kvtier.daemon.engine_ops): no profile, no pools needed."""
        return self.engine.namespaces() if isinstance(req, P.EngineNamespaces) else self.engine.keys(req)

    def stale_reply(self, session: Session, req: P.Msg) -> P.Msg | None:
        """The answer for a connection attached to a namespace retired since (None while it is live)."""
        rt = self._runtime(session)
        return None if self.rollout.serving(rt, session.namespace) else stale_reply(rt, req)

    def namespaces(self, session: Session, req: P.Msg) -> P.NamespacesOk:
        """List the namespaces, or retire one, or promote a profile's canary (`kvtier namespace`)."""
        return self.rollout.request(req)

    def release_owner(self, owner: int) -> int:
        with self._lock:
            mine = [i for i, h in self._held.items() if h.owner == owner]
            for i in mine:
                del self._held[i]
        self.tier.release_owner(owner)
        return sum(rt.manager.release_owner(owner) for rt in self.rollout.runtimes())

    # -- life cycle ----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Expire prewarm pins and forget handles whose leases the manager expired."""
        now = time.monotonic()
        due: list[tuple[Runtime, list[ObjectKey]]] = []
        with self._lock:
            while self._pins and self._pins[0][0] <= now:
                _, _, rt, keys = heapq.heappop(self._pins)
                due.append((rt, keys))
            dead = [
                i
                for i, h in self._held.items()
                if (h.lookup is not None and not h.lookup.leases.live) or h.expires_at <= now
            ]
            stale = [self._held.pop(i) for i in dead]
        for rt, keys in due:
            rt.manager.unpin(keys)
        for held in stale:
            self._release(held)
        self.store.close_unlinked()
        self.reader_slots.tick()  # never the store's reader_check() here: `Index.reader_check` says why
        self.room.tick()

    def _post_doc(self, name: str, doc: dict[str, Any]) -> None:
        self.decisions.post(PutDoc(name, json.dumps(doc, sort_keys=True).encode()))

    def health(self) -> tuple[bool, str]:
        if not self.decisions.alive:
            return False, "the thread that applies the verifier's decisions died"
        if not self.persister.alive:
            return False, "the persist thread died; acknowledged writes are not reaching the store"
        return True, ""

    def degraded(self) -> str:
        """Why serving is degraded though alive (write-back blocked for some forms, a configured cluster down),
        or ""."""
        problems = [p] if (p := cluster_problem(self.lower)) else []
        if reasons := self.persister.reasons():
            problems.insert(0, f"write-back blocked, {self.persister.queued} objects waiting: " + "; ".join(reasons))
        return "; ".join(problems)

    def verifier_heartbeat_age(self, pid: int) -> float | None:
        """Age of the heartbeat the verifier with `pid` last published in the store (None: it has not yet)."""
        doc = verifier_status(self.store)
        return doc.get("heartbeat_age_s") if doc.get("verifier_pid") == pid else None

    def reload(self, cfg: DaemonConfig) -> None:
        """Apply a new store budget and per-form quotas."""
        new = cfg.store
        self.store.set_limits(new.budget_bytes, dict(new.form_quotas))  # also published for the verifier and audit
        with self._start_lock:  # pools adopted later apply this config
            self.rollout.apply(cfg, before=self.cfg)
            self.cfg = cfg

    def drain(self, timeout_s: float) -> bool:
        """Persist every sealed object (acknowledged writes) before shutdown; False, logging how many could not
        be and why, if any remain (blocked forms, or time ran out)."""
        deadline = time.monotonic() + timeout_s
        total = 0
        while True:
            done, n = self.persister.wait_pass(max(0.0, deadline - time.monotonic()))
            total += n
            left = self.persister.queued
            if not left:
                log.info("shutdown flush: %d objects persisted, none left", total)
                return True
            if not done or not n or time.monotonic() >= deadline:
                why = "; ".join(self.persister.reasons()) or "the shutdown deadline passed"
                log.error("shutdown flush: %d acknowledged objects could not be persisted: %s", left, why)
                return False

    def close(self) -> None:
        if getattr(self, "_closed", False):  # also called by a constructor that failed half way
            return
        self._closed = True
        pool_start = getattr(self, "pool_start", None)
        if pool_start is not None:
            pool_start.close(self.cfg.shutdown_timeout_s)
        persister = getattr(self, "persister", None)
        if persister is not None:
            persister.stop(self.cfg.shutdown_timeout_s)
        decisions = getattr(self, "decisions", None)
        if decisions is not None:
            decisions.stop(self.cfg.shutdown_timeout_s)
        rollout = getattr(self, "rollout", None)  # absent when a profile failed to load
        for rt in rollout.all if rollout is not None else getattr(self, "runtimes", {}).values():
            rt.manager.close()
        close_lower(self.lower, self.cfg.shutdown_timeout_s / 2)
        stop_events(getattr(self, "events", None), self.store)
        reader_slots = getattr(self, "reader_slots", None)
        if reader_slots is not None:
            reader_slots.close()
        self.store.close()

    def stats_doc(self) -> StatsDoc:
        """The backend's part of the stats document behind `kvtier status` and the metrics."""
        with self._lock:
            now = time.monotonic()
            pins = [PinStats(rt.name, len(keys), max(0.0, exp - now)) for exp, _, rt, keys in sorted(self._pins)]
        doc = backend_stats(self.rollout.runtimes(), self.store, self.persister, len(pins))
        doc.pins = pins
        doc.cluster = cluster_doc(self.lower)
        doc.namespaces = self.rollout.namespace_stats()
        doc.engines = self.tier.stats.snapshot()
        doc.events = self.events.stats() if self.events is not None else None
        return doc


def build_backend(cfg: DaemonConfig) -> DaemonBackend:
    return DaemonBackend(cfg)
