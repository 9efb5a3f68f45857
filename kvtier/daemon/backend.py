"""The daemon's backend: one `kvtier.gpu.CacheManager` per served profile over one `kvtier.store.DiskStore`.

Requests arrive from the server as protocol structs and leave as replies. Lookups and offloads hand
out *handles* (wire ids) owned by the connection that made them; a connection that goes away has
every handle released, in the manager too (`release_owner`). Offloaded objects are acknowledged once
sealed in the pool and written to the store by a background `Persister`; `durable` and `flush` wait
for the store commit.
"""

from __future__ import annotations

import dataclasses
import fcntl
import heapq
import itertools
import logging
import mmap
import os
import pickle
import stat
import threading
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from kvtier.core.checkvector import CheckVector
from kvtier.core.errors import KvtierError, ProfileError
from kvtier.core.forms import CacheForm, Route
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.profile import ModelProfile, load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.daemon import protocol as P
from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.errors import BadRange, OutOfOrder, WrongType
from kvtier.daemon.server import Session
from kvtier.gpu import AdmissionConfig, AdmissionRefused, CacheManager, PoolLookup, WriteHandle
from kvtier.store import DiskStore, StoreConfig, StoreFull
from kvtier.verifier import verifier_status

log = logging.getLogger(__name__)
PERSIST_BATCH = 32


def resolve_device(device: str) -> str:
    """`auto` is cuda where a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _split_hashes(data: bytes) -> list[bytes]:
    if len(data) % HASH_BYTES:
        raise WrongType(f"hashes must be whole {HASH_BYTES}-byte block hashes, got {len(data)} bytes")
    return [data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]


def _wire_cv(cv: CheckVector) -> P.CheckVectorWire:
    return P.CheckVectorWire(**cv.to_wire())


@dataclasses.dataclass(slots=True)
class Runtime:
    """One served profile: its manager (pools) and what a client needs to map them."""

    name: str
    profile: ModelProfile
    manager: CacheManager
    object_bytes: np.ndarray  # per group

    def pool_infos(self) -> tuple[list[P.PoolInfo], list[int]]:
        """Pool descriptions for an attach reply, and the fds (cpu memfds) that ride along with it."""
        infos: list[P.PoolInfo] = []
        fds: list[int] = []
        for group, pool in zip(self.profile.groups, self.manager.pools()):
            layout = self.profile.layout(group)
            common = dict(
                group=pool.group,
                form=pool.form.value,
                slots=pool.n_slots,
                slot_bytes=pool.slot_stride,
                object_bytes=pool.slot_nbytes,
                dtype=layout.dtype,
                shape=list(layout.shape),
            )
            if pool.fd is not None:
                infos.append(
                    P.PoolInfo(
                        **common, fd_index=len(fds), pool_bytes=os.fstat(pool.fd).st_size, offset=pool.base_offset
                    )
                )
                fds.append(pool.fd)
            else:
                from torch.multiprocessing.reductions import reduce_tensor

                infos.append(P.PoolInfo(**common, ipc=pickle.dumps(reduce_tensor(pool.tensor))))
        return infos, fds

    def grids(self, result: PoolLookup) -> tuple[bytes, bytes]:
        """Slot and generation per (group, block), -1 where the object is not REUSE."""
        shape = result.check_vector.routes.shape
        slots = np.full(shape, -1, dtype="<i8")
        gens = np.full(shape, -1, dtype="<i8")
        groups = {g.name: i for i, g in enumerate(self.profile.groups)}
        for h in self.manager.handles(result):
            g = groups[h.group]
            slots[g, h.block] = h.slot
            gens[g, h.block] = h.generation
        return slots.tobytes(), gens.tobytes()


@dataclasses.dataclass(slots=True)
class Held:
    """What a wire handle stands for: a lookup's leases, or an offload's reserved slots."""

    owner: Hashable
    runtime: Runtime
    lookup: PoolLookup | None = None
    writes: list[WriteHandle] = dataclasses.field(default_factory=list)
    expires_at: float = float("inf")


@dataclasses.dataclass(slots=True)
class TierConn:
    """A raw tier connection: its namespace, its groups (by index), and the client's staging region mapped here."""

    namespace: bytes
    groups: list[tuple[str, CacheForm]]
    staging: torch.Tensor  # uint8 over `mapping`; empty when the client asked for none
    mapping: mmap.mmap | None = None

    def keys(self, items: list[P.TierItem]) -> tuple[list[ObjectKey], list[bytes]]:
        keys: list[ObjectKey] = []
        for it in items:
            if not 0 <= it.group < len(self.groups):
                raise WrongType(
                    f"group index {it.group} is not one of the {len(self.groups)} groups sent with tier_open"
                )
            if len(it.block_hash) != HASH_BYTES or len(it.layout_digest) != 16:
                raise WrongType(f"block_hash and layout_digest must be {HASH_BYTES}-byte digests")
            name, form = self.groups[it.group]
            keys.append(ObjectKey(self.namespace, it.block_hash, name, form))
        return keys, [it.layout_digest for it in items]

    def ranges(self, items: list[P.TierItem]) -> list[torch.Tensor]:
        """Each item's bytes in the staging region; any range outside it is a BadRange (nothing is read or written)."""
        size = self.staging.numel()
        for it in items:
            if it.nbytes <= 0 or it.offset < 0 or it.offset + it.nbytes > size:
                raise BadRange(
                    f"bytes [{it.offset}, {it.offset + it.nbytes}) are not a non-empty range of the {size}-byte staging region"
                )
        return [self.staging[it.offset : it.offset + it.nbytes] for it in items]

    def close(self) -> None:
        self.staging = torch.empty(0, dtype=torch.uint8)
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a load still holds a view; the mapping goes with it
                pass
            self.mapping = None


def _map_staging(fds: list[int], size: int) -> mmap.mmap:
    """Map the client's staging memfd; it must be sealed against shrinking (a shrunk mapping would SIGBUS the daemon)."""
    if len(fds) != 1:
        raise WrongType(f"tier_open with staging_bytes needs exactly one memfd as SCM_RIGHTS, got {len(fds)}")
    fd = fds[0]
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise WrongType(f"the staging descriptor must be a memfd of at least {size} bytes")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise WrongType(
            "the staging memfd must carry F_SEAL_SHRINK (memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS)"
        )
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise WrongType(f"cannot map the staging memfd read-write ({exc.strerror}): open it O_RDWR") from None


class Persister:
    """Writes sealed pool objects to the store in the background (the manager's write-back), bounded.

    A *pass* persists everything sealed before it began. `sealed(n)` counts objects waiting for a
    pass and blocks the sealer while more than `depth` wait (back-pressure); `wait_pass()` returns
    once a pass that began after the call has finished (flush / durable).
    """

    def __init__(self, runtimes: list[Runtime], depth: int) -> None:
        self.runtimes = runtimes
        self.depth = depth
        self._cond = threading.Condition()
        self._waiting = 0  # sealed objects not yet covered by a started pass
        self._requested = 0
        self._completed = 0
        self.persisted = 0
        self.failed_passes = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvtier-persist", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        with self._cond:
            return self._waiting

    def sealed(self, n: int, timeout_s: float) -> None:
        """Note n newly sealed objects; wait (up to timeout_s) while the queue is over its depth."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._waiting += n
            self._requested += 1
            self._cond.notify_all()
            while self._waiting > self.depth and not self._stop:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning(
                        "persist queue over its depth (%d > %d) for %.0fs", self._waiting, self.depth, timeout_s
                    )
                    return
                self._cond.wait(remaining)

    def wait_pass(self, timeout_s: float) -> tuple[bool, int]:
        """Block until a pass begun after this call completes; (done, objects persisted meanwhile)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            before = self.persisted
            self._requested += 1
            ticket = self._requested
            self._cond.notify_all()
            while self._completed < ticket:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False, self.persisted - before
                self._cond.wait(remaining)
            return True, self.persisted - before

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._completed >= self._requested and not self._stop:
                    self._cond.wait()
                if self._stop and self._completed >= self._requested:
                    return
                covering = self._requested
                self._waiting = 0
                self._cond.notify_all()
            for rt in self.runtimes:
                try:
                    while True:  # small batches: the manager pins a batch while storing it, the rest stays evictable
                        n = rt.manager.persist(limit=PERSIST_BATCH)
                        with self._cond:
                            self.persisted += n
                        if n < PERSIST_BATCH:
                            break
                except Exception:  # the pass failed as a whole; objects stay sealed and are retried next pass
                    log.exception("persisting %s objects to the store failed", rt.name)
                    self.failed_passes += 1
            with self._cond:
                self._completed = covering
                self._cond.notify_all()

    def stop(self, timeout_s: float) -> bool:
        """Finish the outstanding passes and end the thread; False if it did not end in time."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class DaemonBackend:
    """What the server calls: attach / lookup / load / release / offload / seal / flush / prewarm, stats, life cycle."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.store = DiskStore(str(cfg.store.root), self._store_config(cfg), writer=True)
        self.runtimes: dict[str, Runtime] = {}
        try:
            for name in cfg.profiles:
                profile = load_profile(name)
                if profile.name in self.runtimes:
                    raise ProfileError(f"profile {profile.name!r} is listed twice", field="profiles")
                codecs = {g.form: cfg.store.codec for g in profile.groups} if cfg.store.codec != "none" else None
                self.store.register_namespace(profile.version, codecs=codecs)
                manager = CacheManager(
                    profile,
                    budgets_bytes={f.value: cfg.pool.budget_bytes[f.value] for f in {g.form for g in profile.groups}},
                    device=self.device,
                    lower=self.store,
                    admission=AdmissionConfig(max_recovering=cfg.recovering_cap, max_recover_queue=cfg.recover_queue),
                    lease_ttl_s=cfg.lease_ttl_s,
                )
                sizes = np.array([g.object_bytes(profile.hash_block_tokens) for g in profile.groups], dtype=np.int64)
                self.runtimes[profile.name] = Runtime(profile.name, profile, manager, sizes)
        except BaseException:
            self.close()
            raise
        self.persister = Persister(list(self.runtimes.values()), cfg.persist_queue_depth)
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._ids = itertools.count(1)
        self._pins: list[tuple[float, int, Runtime, list[ObjectKey]]] = []  # (expiry, seq, runtime, keys) heap
        self._pin_seq = itertools.count()
        self._prewarm_owner = ("prewarm", os.getpid())
        self._tiers: dict[int, TierConn] = {}  # by owner (connection)
        self._closed = False

    @staticmethod
    def _store_config(cfg: DaemonConfig) -> StoreConfig:
        return StoreConfig(
            budget_bytes=cfg.store.budget_bytes,
            form_quotas=StoreConfig.quotas({CacheForm(f): n for f, n in cfg.store.quota_bytes.items()}),
            io_threads=cfg.store.io_threads,
        )

    # -- handles ------------------------------------------------------------------------------------

    def _runtime(self, session: Session) -> Runtime:
        assert session.attached is not None
        return self.runtimes[session.attached]

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

    def attach(self, session: Session, req: P.Attach) -> tuple[P.AttachOk, list[int]]:
        rt = self.runtimes.get(req.profile)
        if rt is None:
            raise ProfileError(
                f"this daemon serves {sorted(self.runtimes)}, not {req.profile!r}; add it to `profiles` in the config"
            )
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
        rt = self._runtime(session)
        hashes = _split_hashes(req.hashes)
        if len(req.groups) != len(req.blocks):
            raise WrongType(f"offload names {len(req.groups)} groups but {len(req.blocks)} block lists")
        groups = {g.name: g for g in rt.profile.groups}
        manager = rt.manager
        slots: list[list[int]] = []
        writes: list[WriteHandle] = []
        refused = 0
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
                    try:
                        handle = manager.begin_write(
                            ObjectKey(manager.namespace, hashes[b], name, group.form),
                            layout_digest=digest,
                            owner=session.owner,
                        )
                    except AdmissionRefused:
                        handle = None
                        refused += 1
                    if handle is not None:
                        writes.append(handle)
                    row.append(handle.slot if handle is not None else -1)
                slots.append(row)
        except BaseException:
            for w in writes:
                manager.abort(w)
            raise
        ident = self._add(Held(session.owner, rt, writes=writes, expires_at=time.monotonic() + self.cfg.lease_ttl_s))
        return P.OffloadOk(ident, slots, refused)

    def seal(self, session: Session, req: P.Seal) -> P.SealOk:
        held = self._get(session, req.offload_id, lookup=False)
        self._pop(req.offload_id)
        manager = held.runtime.manager
        sealed = 0
        try:
            for w in held.writes:
                manager.seal(w, written_bytes=w.nbytes)  # the client filled the whole slot through its mapping
                sealed += 1
        except BaseException:
            for w in held.writes[sealed:]:
                manager.abort(w)
            raise
        if not req.durable:
            self.persister.sealed(sealed, self.cfg.shutdown_timeout_s)
            return P.SealOk(sealed, False)
        self.persister.sealed(sealed, self.cfg.shutdown_timeout_s)
        done, _ = self.persister.wait_pass(max(60.0, self.cfg.shutdown_timeout_s))
        persisted = done and all(
            (st := manager.block_state(w.key.group, w.slot)).recoverable and st.generation == w.generation
            for w in held.writes
        )
        if not persisted:
            raise KvtierError(
                "the store did not commit these objects (evicted first, or a store error; see the daemon log); offload again"
            )
        return P.SealOk(sealed, True)

    def flush(self, session: Session, req: P.Flush) -> P.FlushOk:
        done, persisted = self.persister.wait_pass(req.timeout_s)
        return P.FlushOk(persisted, 0 if done else max(1, self.persister.queued))

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
            self.store.pin(keys, req.ttl_s)
        finally:
            manager.release(result)
        if keys:
            with self._lock:
                heapq.heappush(self._pins, (time.monotonic() + req.ttl_s, next(self._pin_seq), rt, keys))
        n_bytes = int((loaded.sum(axis=1) * rt.object_bytes).sum())
        return P.PrewarmOk(_wire_cv(cv), int(loaded.sum()), n_bytes, pinned, time.perf_counter() - started)

    # -- raw tier ops (a client's own keys and namespace over the store; no pools) ---------------------

    def tier_open(self, session: Session, req: P.TierOpen, fds: list[int]) -> P.TierOpenOk:
        """Register the client's namespace and map its staging memfd (the server closes `fds` afterwards)."""
        fields = {f.name for f in dataclasses.fields(VersionKey)}
        if set(req.version_key) != fields:
            raise WrongType(f"version_key must have exactly the fields {sorted(fields)}")
        version_key = VersionKey.from_dict(req.version_key)
        groups: list[tuple[str, CacheForm]] = []
        for name, form in req.groups:
            if not name or len(name.encode()) > 32 or name in (g for g, _ in groups):
                raise WrongType(f"group names must be distinct and 1..32 bytes, got {name!r}")
            try:
                parsed = CacheForm(form)
            except ValueError:
                parsed = CacheForm.ON_DISK
            if parsed is CacheForm.ON_DISK:
                raise WrongType(f"group {name!r}: form must be one of compressed, indexer, tail, swa, not {form!r}")
            groups.append((name, parsed))
        if not groups:
            raise WrongType("tier_open needs at least one group")
        if req.staging_bytes < 0:
            raise WrongType(f"staging_bytes must be >= 0, got {req.staging_bytes}")
        mapping = _map_staging(fds, req.staging_bytes) if req.staging_bytes else None
        try:
            codecs = {form: self.cfg.store.codec for _, form in groups} if self.cfg.store.codec != "none" else None
            namespace = self.store.register_namespace(version_key, codecs=codecs)
        except BaseException:
            if mapping is not None:
                mapping.close()
            raise
        staging = (
            torch.frombuffer(mapping, dtype=torch.uint8) if mapping is not None else torch.empty(0, dtype=torch.uint8)
        )
        with self._lock:
            self._tiers[session.owner] = TierConn(namespace, groups, staging, mapping)
        log.info(
            "connection %d (pid %d): tier namespace %s, %d groups, %d staging bytes",
            session.owner,
            session.peer.pid,
            namespace.hex(),
            len(groups),
            req.staging_bytes,
        )
        return P.TierOpenOk(namespace, str(self.store.root), self.store.io_backend)

    def _tier(self, session: Session) -> TierConn:
        with self._lock:
            return self._tiers[session.owner]

    def tier_has(self, session: Session, req: P.TierHas) -> P.TierReasons:
        keys, digests = self._tier(session).keys(req.items)
        return P.TierReasons(bytes(self.store.has(keys, digests)))

    def tier_store(self, session: Session, req: P.TierStore) -> P.TierStored:
        """Persist the staged objects with one store_many (one fdatasync + one commit); answered after the commit."""
        conn = self._tier(session)
        keys, digests = conn.keys(req.items)
        payloads = conn.ranges(req.items)
        try:
            self.store.store_many(list(zip(keys, payloads, digests)))
        except StoreFull as exc:
            return P.TierStored(0, exc.limit, str(exc))
        return P.TierStored(len(keys))

    def tier_load(self, session: Session, req: P.TierLoad) -> P.TierReasons:
        """Read and verify each record into its staged range (a failed one is quarantined; its range is not to be used)."""
        conn = self._tier(session)
        keys, digests = conn.keys(req.items)
        outs = conn.ranges(req.items)
        reasons = self.store.load_into([LoadRequest(k, o, d) for k, o, d in zip(keys, outs, digests)])
        return P.TierReasons(bytes(reasons))

    def release_owner(self, owner: int) -> int:
        with self._lock:
            mine = [i for i, h in self._held.items() if h.owner == owner]
            for i in mine:
                del self._held[i]
            tier = self._tiers.pop(owner, None)
        if tier is not None:
            tier.close()
        return sum(rt.manager.release_owner(owner) for rt in self.runtimes.values())

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
        self.store.reader_check()

    def health(self) -> tuple[bool, str]:
        if not self.persister.alive:
            return False, "the persist thread died; acknowledged writes are not reaching the store"
        return True, ""

    def reload(self, cfg: DaemonConfig) -> None:
        """Apply a new store budget and per-form quotas."""
        new = self._store_config(cfg)
        self.store.set_limits(new.budget_bytes, dict(new.form_quotas))  # also published for the verifier and audit
        self.cfg = cfg

    def drain(self, timeout_s: float) -> bool:
        """Persist every sealed object (acknowledged writes) before shutdown; False if time ran out."""
        done, n = self.persister.wait_pass(timeout_s)
        log.info("shutdown flush: %d objects persisted%s", n, "" if done else " (timed out)")
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        persister = getattr(self, "persister", None)
        if persister is not None:
            persister.stop(self.cfg.shutdown_timeout_s)
        for rt in getattr(self, "runtimes", {}).values():
            rt.manager.close()
        self.store.close()

    # -- stats ----------------------------------------------------------------------------------------

    def stats_doc(self) -> dict[str, Any]:
        """The stats document behind `kvtier status` and the metrics (see kvtier.daemon.metrics)."""
        profiles = []
        forms: dict[str, dict[str, Any]] = {}
        for rt in self.runtimes.values():
            snap = rt.manager.counters()
            pools: dict[str, dict[str, int]] = {}
            for pool in rt.manager.pools():
                p = pools.setdefault(pool.form.value, {"slots": 0, "bytes": 0})
                p["slots"] += pool.n_slots
                p["bytes"] += pool.n_slots * pool.slot_stride
            for form, p in pools.items():
                p["used"] = snap["used_slots"].get(form, 0)
                p["quota"] = snap["quota_slots"].get(form, 0)
            profiles.append(
                {
                    "name": rt.name,
                    "namespace": rt.manager.namespace.hex(),
                    "hash_block_tokens": rt.profile.hash_block_tokens,
                    "device": str(rt.manager.device),
                    "pools": pools,
                    "live_leases": snap["live_leases"],
                    "recovering": snap["recovering"],
                    "leases_expired": snap["leases_expired"],
                }
            )
            for form, f in snap["forms"].items():
                _merge_form(forms.setdefault(form, _empty_form()), f)
        store = self.store.stats()
        store["used_bytes"] = store.get("record_bytes", 0)
        store["bytes_by_state"] = {"live": store.get("record_bytes", 0)}
        store["persist_queue"] = self.persister.queued
        store["persisted"] = self.persister.persisted
        with self._lock:
            prewarm_pins = len(self._pins)
        return {
            "profiles": profiles,
            "forms": forms,
            "store": store,
            "prewarm_pins": prewarm_pins,
            "verifier": verifier_status(self.store),  # what the verifier last published in the index
        }


def _empty_form() -> dict[str, Any]:
    return {
        "lookups": 0,
        "reuse": 0,
        "recover": 0,
        "recompute": 0,
        "recover_ok": 0,
        "recover_failed": 0,
        "admission_rejections": 0,
        "evictions": 0,
        "recompute_reasons": {},
        "recovery_latency": None,
    }


def _merge_form(out: dict[str, Any], f: dict[str, Any]) -> None:
    """Fold one manager's per-form counters into the daemon-wide ones (histogram buckets made cumulative)."""
    reasons = f.get("recompute", {})
    out["lookups"] += f["objects_looked_up"]
    out["reuse"] += f["reuse"]
    out["recover"] += f["recover"]
    out["recompute"] += sum(reasons.values())
    out["recover_ok"] += f["recovers_ok"]
    out["recover_failed"] += f["recovers_failed"]
    out["admission_rejections"] += reasons.get("admission", 0)
    out["evictions"] += f["evictions"]
    for reason, n in reasons.items():
        out["recompute_reasons"][reason] = out["recompute_reasons"].get(reason, 0) + n
    lat = f["recovery_latency_s"]
    cumulative = np.cumsum(lat["counts"]).tolist()
    hist = out["recovery_latency"]
    if hist is None:
        les = ["+Inf" if le == float("inf") else le for le in lat["le"]]
        out["recovery_latency"] = {
            "buckets": [[le, c] for le, c in zip(les, cumulative)],
            "sum": lat["sum"],
            "count": lat["count"],
        }
    else:
        for bucket, c in zip(hist["buckets"], cumulative):
            bucket[1] += c
        hist["sum"] += lat["sum"]
        hist["count"] += lat["count"]


def build_backend(cfg: DaemonConfig) -> DaemonBackend:
    return DaemonBackend(cfg)
