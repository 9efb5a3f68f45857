"""Which pools serve which version of each profile: its live version, a canary beside it, and rollouts between.

A profile's version key is its own with the fields of `[versions.<profile>]` laid over (weights digest, kernel
ABI, compressor / indexer version, dtype / layout); `[canary.<profile>]` names a second version served beside
it on a second set of pools, which engines choose by attaching to `<profile>@canary`. Both sections are read at
start and re-read on reload (SIGHUP); a reload acts on a section only when it differs from the one applied
before, so a `kvtier namespace promote` / `retire` stands until the config changes that profile again.

- A new live version with no canary of it: its namespace is registered live in the store and made the live
  pools' version in place (`CacheManager.set_version`: the pools stay where they are; objects of the old
  namespace turn `stale_version` and are evicted first); the old namespace is retired in the store.
- A new live version equal to the canary's, or `promote`: the canary's pools become the live ones (engines on
  them keep going), the old live pools are kept for the next canary, and the old namespace is retired.
- A canary removed, replaced or retired: its namespace is retired (a replacement reuses its pools).

Retired namespaces' records read as `stale_version` and the verifier reclaims them in the background at its
rate. Leases already handed out finish normally. A connection attached to pools that no longer serve the
namespace it attached to answers RECOMPUTE `stale_version` to lookups and refuses offloads (never storing
old-version bytes under a new namespace); attaching again gets the current one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from kvtier.core.checkvector import CheckVector
from kvtier.core.config import DaemonConfig
from kvtier.core.errors import KvtierError, ProfileError
from kvtier.core.forms import Reason, Route
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.profile import ModelProfile
from kvtier.core.rollout_doc import ROLLOUT_DOC
from kvtier.core.versions import VersionKey
from kvtier.daemon.runtime import Runtime
from kvtier.store import DiskStore, namespace_usage
from kvtier.wire import messages as P
from kvtier.wire.stats import NamespaceStats

log = logging.getLogger(__name__)
CANARY = "canary"


class NamespaceRefused(KvtierError):
    """A namespace operation that would leave a profile without a live version, or names no single namespace."""

    code = "namespace_refused"


class Rollout:
    """The live and canary pools of every served profile, and the retired pools kept for a later canary.

    `live` is the backend's profile -> Runtime map (attach by plain profile name); `all` lists every pool set
    allocated (the persister writes each back; leases on retired pools still finish there).
    """

    def __init__(
        self, store: DiskStore, codec: str, live: dict[str, Runtime], new_pools: Callable[[ModelProfile], Runtime]
    ) -> None:
        self.store = store
        self.codec = codec
        self.live = live
        self.canary: dict[str, Runtime] = {}
        self._spare: dict[str, Runtime] = {}
        self.all: list[Runtime] = list(live.values())
        self._new_pools = new_pools
        self._lock = threading.RLock()

    # -- attach and serve -------------------------------------------------------------------------------

    def runtime_for(self, name: str) -> Runtime:
        """The pools an attach to `name` maps: `<profile>` (or `<profile>@live`) or `<profile>@canary`."""
        profile, _, version = name.partition("@")
        with self._lock:
            if version in ("", "live"):
                rt = self.live.get(profile)
            elif version == CANARY:
                rt = self.canary.get(profile)
                if rt is None and profile in self.live:
                    raise ProfileError(
                        f"profile {profile!r} has no canary now; add [canary.{profile}] to the config and reload"
                    )
            else:
                raise ProfileError(f"{name!r}: attach to <profile> or <profile>@canary, not @{version}")
        if rt is None:
            raise ProfileError(
                f"this daemon serves {sorted(self.live)}, not {profile!r}; add it to `profiles` in the config"
            )
        return rt

    def serving(self, rt: Runtime, namespace: bytes) -> bool:
        """Whether `rt` still serves `namespace` (the one a connection attached to) as a live or canary version."""
        with self._lock:
            return rt.manager.namespace == namespace and rt in (
                self.live.get(rt.profile.name),
                self.canary.get(rt.profile.name),
            )

    def runtimes(self) -> list[Runtime]:
        """Every pool set: live ones first, then canary, then retired ones."""
        with self._lock:
            return [*self.live.values(), *self.canary.values(), *self._spare.values()]

    # -- changes ----------------------------------------------------------------------------------------

    def add_live(self, runtimes: list[Runtime]) -> None:
        """Pools allocated after the start (`kvtier.daemon.pool_start`) become their profiles' live ones."""
        with self._lock:
            for rt in runtimes:
                self.live[rt.profile.name] = rt
                self.all.append(rt)  # the same list the persister walks

    def apply(self, cfg: DaemonConfig, before: DaemonConfig | None = None) -> None:
        """Serve the versions and canary `cfg` names: all of them at start, the changed sections on reload."""
        with self._lock:
            for name in list(self.live):
                own = self.live[name].profile.version
                if before is None or cfg.versions.get(name) != before.versions.get(name):
                    self._make_live(name, own.bumped(**cfg.versions.get(name, {})))
                if before is None or cfg.canary.get(name) != before.canary.get(name):
                    fields = cfg.canary.get(name)
                    if fields is not None:
                        self._start_canary(name, own.bumped(**fields))
                    elif name in self.canary:
                        self._retire_canary(name)
            self._publish()

    def promote(self, name: str) -> str:
        """The profile's canary becomes its live version; the live namespace is retired."""
        with self._lock:
            if name not in self.live:
                raise NamespaceRefused(f"this daemon serves {sorted(self.live)}, not {name!r}")
            if name not in self.canary:
                raise NamespaceRefused(f"profile {name!r} has no canary to promote; add [canary.{name}] and reload")
            done = self._promote(name)
            self._publish()
            return done

    def retire(self, prefix: str) -> str:
        """Retire the namespace `prefix` names: a canary, or one no profile serves (never a live version)."""
        ns = self._resolve(prefix)
        with self._lock:
            for name, rt in self.live.items():
                if rt.manager.namespace == ns:
                    raise NamespaceRefused(
                        f"{ns.hex()} is the live version of {name}: promote a canary (`kvtier namespace promote"
                        f" {name}`) or set [versions.{name}] in the config and reload"
                    )
            for name, rt in self.canary.items():
                if rt.manager.namespace == ns:
                    done = self._retire_canary(name)
                    self._publish()
                    return done
            entry = self.store.namespaces().get(ns)
            if entry is not None and not entry.live:
                return f"{ns.hex()} was retired already"
            self.store.retire_namespace(ns)
            return f"retired {ns.hex()} (no profile served it)"

    def _resolve(self, prefix: str) -> bytes:
        text = prefix.strip().lower()
        matches = [ns for ns in self.store.namespaces() if text and ns.hex().startswith(text)]
        if len(matches) != 1:
            what = "no namespace" if not matches else f"{len(matches)} namespaces"
            raise NamespaceRefused(f"{what} of the store begin with {prefix!r}; `kvtier namespace list` shows them")
        return matches[0]

    def _register(self, name: str, version: VersionKey) -> None:
        groups = self.live[name].profile.groups
        codecs = {g.form: self.codec for g in groups} if self.codec != "none" else None
        self.store.register_namespace(version, codecs=codecs)  # live (again, for a rollback)

    def _make_live(self, name: str, version: VersionKey) -> None:
        rt = self.live[name]
        old = rt.manager.namespace
        if version.namespace == old:
            return
        canary = self.canary.get(name)
        if canary is not None and canary.manager.namespace == version.namespace:
            self._promote(name)
            return
        self._register(name, version)
        rt.manager.set_version(version)
        self.store.retire_namespace(old)
        log.info("profile %s: namespace %s live, %s retired", name, version.namespace.hex(), old.hex())

    def _start_canary(self, name: str, version: VersionKey) -> None:
        if version.namespace == self.live[name].manager.namespace:
            log.warning("[canary.%s] names the live version of %s: no canary served", name, name)
            if name in self.canary:
                self._retire_canary(name)
            return
        rt = self.canary.get(name)
        if rt is not None and rt.manager.namespace == version.namespace:
            return
        self._register(name, version)
        if rt is not None:  # a canary replaced: its pools serve the new one, its namespace is retired
            old = rt.manager.namespace
            rt.manager.set_version(version)
            self.store.retire_namespace(old)
            log.info("profile %s: canary %s replaces %s (retired)", name, version.namespace.hex(), old.hex())
            return
        rt = self._spare.pop(name, None)
        if rt is None:
            rt = self._new_pools(self.live[name].profile)
            self.all.append(rt)
        rt.manager.set_version(version)
        rt.name = f"{name}@{CANARY}"
        self.canary[name] = rt
        log.info(
            "profile %s: canary %s served beside %s",
            name,
            version.namespace.hex(),
            self.live[name].manager.namespace.hex(),
        )

    def _promote(self, name: str) -> str:
        canary, old = self.canary.pop(name), self.live[name]
        old_ns = old.manager.namespace
        canary.name, old.name = name, f"{name}@retired"
        self.live[name], self._spare[name] = canary, old
        self.store.retire_namespace(old_ns)
        done = f"profile {name}: canary {canary.manager.namespace.hex()} promoted live, {old_ns.hex()} retired"
        log.info("%s", done)
        return done

    def _retire_canary(self, name: str) -> str:
        rt = self.canary.pop(name)
        rt.name = f"{name}@retired"
        self._spare[name] = rt
        self.store.retire_namespace(rt.manager.namespace)
        done = f"profile {name}: canary {rt.manager.namespace.hex()} retired"
        log.info("%s", done)
        return done

    # -- what is served ---------------------------------------------------------------------------------

    def _roles(self) -> dict[bytes, tuple[str, str]]:
        roles = {rt.manager.namespace: (CANARY, name) for name, rt in self.canary.items()}
        roles.update({rt.manager.namespace: ("live", name) for name, rt in self.live.items()})
        return roles

    def _publish(self) -> None:
        """The roles, for `kvtier audit` (which reads the store, not the daemon)."""
        doc = {ns.hex(): {"state": state, "profile": name} for ns, (state, name) in self._roles().items()}
        self.store.put_meta_doc(ROLLOUT_DOC, {"namespaces": doc})

    def namespace_stats(self) -> list[NamespaceStats]:
        """Every namespace of the store (or with records in it): state, serving profile, records and bytes."""
        with self._lock:
            roles = self._roles()
        entries = self.store.namespaces()
        usage = namespace_usage(self.store.index)
        out = []
        for ns in sorted(set(entries) | set(usage), key=lambda n: (n not in roles, n)):
            entry = entries.get(ns)
            state, profile = roles.get(ns, ("store" if entry is not None and entry.live else "retired", ""))
            use = usage.get(ns)
            model = entry.version_key.model_id if entry is not None else "?"
            out.append(
                NamespaceStats(ns.hex(), state, profile, model, use.records if use else 0, use.bytes if use else 0)
            )
        return out

    def request(self, req: P.Msg) -> P.NamespacesOk:
        """A `namespaces` / `namespace_retire` / `namespace_promote` request."""
        done = ""
        if isinstance(req, P.NamespaceRetire):
            done = self.retire(req.namespace)
        elif isinstance(req, P.NamespacePromote):
            done = self.promote(req.profile)
        return P.NamespacesOk(self.namespace_stats(), done)


def stale_reply(rt: Runtime, req: P.Msg) -> P.Msg | None:
    """The answer to a lookup / offload / prewarm of a connection attached to a namespace no longer live."""
    if isinstance(req, (P.Lookup, P.Prewarm)):
        cv = _stale_vector(rt, len(req.hashes) // HASH_BYTES)
        wire = P.CheckVectorWire(**cv.to_wire())
        if isinstance(req, P.Prewarm):
            return P.PrewarmOk(wire, 0, 0, 0, 0.0)
        none = np.full(cv.routes.shape, -1, dtype="<i8").tobytes()
        return P.LookupOk(0, wire, none, none)
    if isinstance(req, P.Offload):  # nothing reserved (offload 0): its seal and release are no-ops below
        return P.OffloadOk(0, [[-1] * len(b) for b in req.blocks], sum(len(b) for b in req.blocks))
    if isinstance(req, P.Seal) and req.offload_id == 0:
        return P.SealOk(0, False)
    if isinstance(req, P.Release) and req.handle == 0:
        return P.Released(0)
    return None


def _stale_vector(rt: Runtime, n_blocks: int) -> CheckVector:
    shape = (len(rt.profile.groups), n_blocks)
    routes = np.full(shape, int(Route.RECOMPUTE), dtype=np.int8)
    reasons = np.full(shape, int(Reason.STALE_VERSION), dtype=np.int8)
    return CheckVector.build(rt.manager.profile, routes, reasons)
