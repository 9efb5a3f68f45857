"""Random operations on one CacheManager and the checks that must hold after each (shared by the
hypothesis machine, the 10,000-operation run and the threaded run)."""

from __future__ import annotations

import threading

import torch

from kvtier.core import GroupKind, Reason, Route, VersionError, block_hashes
from kvtier.core.tier import ObjectKey
from kvtier.gpu import AdmissionRefused, PartialBlock, PoolLookup, StaleHandle
from support.gpuworld import PROFILE, make, payload, prompt

N_PROMPTS = 4
N_BLOCKS = 6
GROUPS = [g.name for g in PROFILE.groups]
EXPECTED = (StaleHandle, AdmissionRefused, VersionError)


class Driver:
    """`strict`: one thread only, so every REUSE object must still read right after its lookup."""

    def __init__(self, *, strict: bool = True) -> None:
        self.strict = strict
        self.m, self.tier, self.clock = make(blocks=7, state_blocks=4, ttl=20.0, max_recovering=3, max_recover_queue=40)
        self.addresses = self.m.pool_addresses()
        self.versions = [PROFILE.version, PROFILE.version.bumped(indexer_version="ref-indexer/2")]
        # prompts share prefixes of different lengths with prompt 0
        self.tokens = [prompt(0, N_BLOCKS)] + [prompt(i, N_BLOCKS, shared=(0, i + 1)) for i in range(1, N_PROMPTS)]
        self._hashes: dict[tuple[bytes, int], list[bytes]] = {}
        self.written: set[tuple[bytes, bytes, str]] = set()  # (namespace, hash, group) ever sealed
        self.lock = threading.Lock()
        self.checked_reads = 0

    def hashes(self, ns: bytes, i: int) -> list[bytes]:
        with self.lock:
            if (ns, i) not in self._hashes:
                self._hashes[(ns, i)] = block_hashes(ns, self.tokens[i], PROFILE.hash_block_tokens)
            return self._hashes[(ns, i)]

    def _key(self, ns: bytes, i: int, b: int, group: str) -> ObjectKey:
        return ObjectKey(ns, self.hashes(ns, i)[b], group, PROFILE.group(group).form)

    # -- operations ---------------------------------------------------------------------------

    def write(self, i: int, upto: int, checkpoint: bool) -> None:
        """History of blocks [0, upto) and, at a checkpoint, the state objects the boundary needs."""
        m = self.m
        ns = m.namespace
        hs = self.hashes(ns, i)
        for b in range(upto):
            for g in PROFILE.groups:
                if g.kind is GroupKind.STATE and not (
                    checkpoint and b >= upto - g.blocks_needed(PROFILE.hash_block_tokens)
                ):
                    continue
                if not self.strict:  # another thread may look it up the moment it is sealed
                    with self.lock:
                        self.written.add((ns, hs[b], g.name))
                try:
                    m.write_block(
                        self._key(ns, i, b, g.name),
                        payload(PROFILE, g.name, hs[b], ns),
                        layout_digest=m.layout_digest(g.name),
                    )
                except EXPECTED:
                    continue
                with self.lock:
                    self.written.add((ns, hs[b], g.name))

    def partial(self, i: int, b: int, g: int) -> None:
        ns = self.m.namespace
        try:
            h = self.m.begin_write(self._key(ns, i, b, GROUPS[g]), layout_digest=self.m.layout_digest(GROUPS[g]))
        except EXPECTED:
            return
        if h is not None:
            try:
                self.m.seal(h, written_bytes=h.nbytes // 2)
            except (PartialBlock, StaleHandle):
                return
            raise AssertionError("a half-written block was sealed")

    def dangling(self, i: int, b: int, g: int, owner: int) -> None:
        """Begin a write and never finish it (the owner dies or the TTL reclaims it); evict a resident
        copy first, so the open write sits inside a prefix that is otherwise cached."""
        ns = self.m.namespace
        self.evict(i, b, g)
        try:
            self.m.begin_write(
                self._key(ns, i, b, GROUPS[g]), layout_digest=self.m.layout_digest(GROUPS[g]), owner=owner
            )
        except EXPECTED:
            pass

    def lookup(self, i: int, owner: int, recover: bool) -> PoolLookup | None:
        ns = self.m.namespace
        try:
            result = self.m.lookup(self.hashes(ns, i), owner=owner, namespace=ns)
            if recover:
                result = self.m.recover(result, timeout_s=5.0)
        except EXPECTED:
            return None
        self.check(result, i)
        return result

    def recover_later(self, result: PoolLookup, i: int) -> None:
        """Recover a lookup made some operations ago (its lease may be gone, its rows shared or evicted)."""
        try:
            self.check(self.m.recover(result, timeout_s=5.0), i)
        except EXPECTED:
            pass

    def evict(self, i: int, b: int, g: int) -> None:
        try:
            self.m.evict([self._key(self.m.namespace, i, b, GROUPS[g])])
        except VersionError:
            pass

    def pin(self, i: int, b: int, g: int, on: bool) -> None:
        key = self._key(self.m.namespace, i, b, GROUPS[g])
        try:
            (self.m.pin if on else self.m.unpin)([key])
        except VersionError:  # another thread bumped the version in between
            pass

    def bump(self) -> None:
        live = self.m.namespace  # read once: another thread may bump it while the versions are searched
        current = self.versions.index(next(v for v in self.versions if v.namespace == live))
        self.m.set_version(self.versions[1 - current])

    # -- checks -------------------------------------------------------------------------------

    def check(self, result: PoolLookup, i: int) -> None:
        """Every REUSE object reads back exactly what was written for its key; every REUSE/RECOVER object
        of the hit was really written (never a partial or dangling write); the tier holds every RECOVER."""
        cv = result.check_vector
        ns = result.leases.namespace
        hs = self.hashes(ns, i)
        assert cv.hit_blocks <= len(hs)
        for b, group, _form, route, reason in cv.entries():
            if route is Route.RECOMPUTE:
                assert reason is not Reason.OK
                continue
            assert b < cv.hit_blocks
            with self.lock:
                assert (ns, hs[b], group) in self.written, f"{route.name} for {group} block {b} that was never sealed"
            if route is Route.RECOVER:
                assert self.tier is not None
                key = ObjectKey(ns, hs[b], group, PROFILE.group(group).form)
                assert self.tier.has([key], [self.m.layout_digest(group)]) == [Reason.OK] or ns != self.m.namespace
        self.read_all(result, i, fresh=True)

    def read_all(self, result: PoolLookup, i: int, *, fresh: bool = False) -> None:
        """Through every handle: the written bytes, or StaleHandle; never other bytes. A `fresh` result
        read by the only thread must not be stale at all (no REUSE of anything unsealed or gone)."""
        ns = result.leases.namespace
        hs = self.hashes(ns, i)
        for b, g in zip(*(result.check_vector.routes.T == Route.REUSE).nonzero()):
            group = GROUPS[g]
            try:
                data = self.m.read(self.m.handle(result, group, int(b)), copy=True)
            except StaleHandle:
                assert not (fresh and self.strict), f"REUSE {group} block {b} was stale right after the lookup"
                continue
            assert torch.equal(data, payload(PROFILE, group, hs[b], ns)), f"{group} block {b} read other bytes"
            with self.lock:
                self.checked_reads += 1

    def invariants(self) -> None:
        """When no operation is running: the table is consistent, nothing is left RECOVERING, pools never moved."""
        assert self.m.invariant_violations() == []
        assert self.m.counters().recovering == 0
        assert self.m.pool_addresses() == self.addresses
