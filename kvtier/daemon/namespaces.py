"""Version rollouts without a restart: a profile's version key as the config sets it, applied at start and reload.

`[versions.<profile>]` lays version-key fields (weights digest, kernel ABI, compressor / indexer version,
dtype / layout) over the profile's own. When that changes the namespace, the new one is registered live in
the store and made the pool's live version (`CacheManager.set_version`: the pools stay where they are;
objects of the old namespace turn `stale_version` and are evicted first); the old namespace is retired in the
store, so its records read as `stale_version` and the verifier reclaims them in the background at its rate.
Leases already handed out finish normally. A connection attached before the switch keeps hashing under the
old namespace: its lookups answer RECOMPUTE `stale_version` and its offloads are refused (never stored under
the new namespace); a connection that attaches again gets the new one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from kvtier.core.checkvector import CheckVector
from kvtier.core.forms import Reason, Route
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.versions import VersionKey
from kvtier.daemon.runtime import Runtime
from kvtier.store import DiskStore
from kvtier.wire import messages as P

log = logging.getLogger(__name__)


def target_version(rt: Runtime, versions: Mapping[str, Mapping[str, str]]) -> VersionKey:
    """The version key the config asks `rt` to serve: the profile's own, with the configured fields laid over."""
    return rt.profile.version.bumped(**versions.get(rt.name, {}))


def apply_versions(
    store: DiskStore, runtimes: Mapping[str, Runtime], versions: Mapping[str, Mapping[str, str]], codec: str
) -> list[tuple[str, bytes, bytes]]:
    """Make every runtime serve its configured version; returns (profile, old, new namespace) per switch."""
    switched = []
    for rt in runtimes.values():
        version = target_version(rt, versions)
        old = rt.manager.namespace
        if version.namespace == old:
            continue
        codecs = {g.form: codec for g in rt.profile.groups} if codec != "none" else None
        store.register_namespace(version, codecs=codecs)  # live (again, for a rollback)
        rt.manager.set_version(version)
        store.retire_namespace(old)
        log.info("profile %s: namespace %s live, %s retired", rt.name, version.namespace.hex(), old.hex())
        switched.append((rt.name, old, version.namespace))
    return switched


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
