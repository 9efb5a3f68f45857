"""ClusterTier: a LowerTier on Mooncake Store whose objects are kvtier objects (header + payload), verified on get."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.cluster import header as H
from kvtier.cluster.bytes_copy import from_tensor, into_tensor
from kvtier.cluster.errors import ClusterError, ClusterPutError, ClusterRequestError, ClusterUnavailable
from kvtier.cluster.link import ClientLink
from kvtier.cluster.mooncake_client import BUFFER_TOO_SMALL, NOT_FOUND, TOO_LARGE, MooncakeClient
from kvtier.cluster.stats import ClusterStats, Counters, LatencyRecorder
from kvtier.core.cluster_config import ClusterConfig
from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest, MoreRequests, ObjectKey, every_request

log = logging.getLogger(__name__)

# Miss labels beyond the header verdicts (stats and docs/cluster.md).
MISSING = "missing"  # the cluster does not have it (never stored, evicted from a full pool, lost with a holder)
UNAVAILABLE = "unavailable"  # no answer within the deadline, or the cluster is marked down
ERROR = "error"  # the cluster answered with an error code for this object
TOO_BIG = "too_big"  # larger than this reader's object by more than READ_SLACK: another size, left in place

# Gets read up to this much beyond the expected object, so an object slightly too long is read and judged by
# its header (and removed if bad) instead of being refused by the cluster unread.
READ_SLACK = 4096

# A verdict's route reason: an object in another layout is an ABI mismatch, every other fault is corruption.
_VERDICT_REASON = {v: Reason.ABI_MISMATCH if v is H.Verdict.LAYOUT else Reason.CORRUPT for v in H.Verdict}
# Faults that mean the bytes under a kvtier key are not what any kvtier writer put there: removed, so the
# key can be written again (Mooncake never overwrites an existing key).
_REMOVE = frozenset(H.Verdict) - {H.Verdict.OK, H.Verdict.LAYOUT}


def _flat(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.uint8 or not t.is_contiguous():
        raise ClusterRequestError("cluster objects are contiguous uint8 tensors")
    return t.view(-1)


class ClusterTier:
    """The cluster as a tier: has / load_into / store(_many) / pin / remove; faults are misses with a reason."""

    def __init__(self, cfg: ClusterConfig, client: MooncakeClient | None = None) -> None:
        self.cfg = cfg
        self._link = ClientLink(cfg, (lambda _cfg: client) if client is not None else MooncakeClient)
        self._counters = Counters(
            "lookups", "found", "hits", "bytes_loaded", "stored", "bytes_stored", "put_failed", "removed"
        )
        self._lookup_latency = LatencyRecorder()
        self._load_latency = LatencyRecorder()
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-cluster-janitor")

    @property
    def client(self) -> MooncakeClient:
        """The Mooncake client; ClusterUnavailable while it is not connected (the cluster was down at start)."""
        return self._link.client

    def name(self, key: ObjectKey) -> str:
        return H.object_name(self.cfg.key_prefix, key)

    # ----------------------------------------------------------------- lookups and loads

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        """One batched existence call within lookup_timeout_s: OK where the cluster has an object under the key."""
        if len(keys) != len(layout_digests):
            raise ClusterRequestError("has(): keys and layout_digests differ in length: pass one digest per key")
        if not keys:
            return []
        t0 = time.monotonic()
        self._counters.add("lookups", len(keys))
        try:
            found = self.client.exists([self.name(k) for k in keys])
        except ClusterUnavailable as exc:
            log.debug("cluster lookup: %s", exc)
            self._counters.miss(UNAVAILABLE, len(keys))
            return [Reason.MISSING] * len(keys)
        finally:
            self._lookup_latency.observe(time.monotonic() - t0)
        out = []
        for f in found:
            if f:
                out.append(Reason.OK)
            else:
                self._counters.miss(MISSING if f is False else ERROR)
                out.append(Reason.MISSING)
        self._counters.add("found", out.count(Reason.OK))
        return out

    def load_into(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> list[Reason]:
        """Get, verify (header against the request, payload checksum) and copy each object into its `out`."""
        requests = every_request(requests, more)
        if not requests:
            return []
        t0 = time.monotonic()
        outs = [_flat(r.out) for r in requests]
        results: list[Reason | None] = [None] * len(requests)
        bad: list[str] = []

        def sink(i: int, got: memoryview | int) -> None:
            req = requests[i]
            if isinstance(got, int):
                label = MISSING if got == NOT_FOUND else TOO_BIG if got == BUFFER_TOO_SMALL else ERROR
                self._counters.miss(label)
                results[i] = Reason.ABI_MISMATCH if label == TOO_BIG else Reason.MISSING
                return
            verdict = H.verify(got, req.key, req.layout_digest, outs[i].numel())
            if verdict is H.Verdict.OK:
                into_tensor(outs[i], got[H.HEADER_BYTES :])
                self._counters.add("hits")
                self._counters.add("bytes_loaded", len(got))
                results[i] = Reason.OK
                return
            log.warning("cluster object %s is not served: %s", self.name(req.key), verdict.value)
            self._counters.miss(verdict.value)
            if verdict in _REMOVE:
                bad.append(self.name(req.key))
            results[i] = _VERDICT_REASON[verdict]

        names = [self.name(r.key) for r in requests]
        try:
            self.client.get(names, [H.HEADER_BYTES + o.numel() + READ_SLACK for o in outs], sink)
        except ClusterUnavailable as exc:
            log.debug("cluster load: %s", exc)
        finally:
            self._load_latency.observe(time.monotonic() - t0)
        for i, r in enumerate(results):
            if r is None:
                self._counters.miss(UNAVAILABLE)
                results[i] = Reason.MISSING
        if bad:
            self._janitor.submit(self._remove_quietly, bad)
        return [r for r in results if r is not None]

    # ----------------------------------------------------------------- writes

    def store(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes) -> None:
        self.store_many([(key, payload, layout_digest)])

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        """Put objects (replicas per config); raises ClusterPutError naming how many the cluster refused.

        The cluster is a cache: an object stored here may be lost later (evicted, holder gone) and then reads as
        a miss. A key already present is kept as it is.
        """
        if not items:
            return
        flats = [_flat(p) for _, p, _ in items]
        for key, _, digest in items:
            if len(digest) != 16:
                raise ClusterRequestError(f"layout digest for {self.name(key)} must be 16 bytes")

        def fill(i: int, buf: memoryview) -> None:
            key, _, digest = items[i]
            body = buf[H.HEADER_BYTES :]
            from_tensor(body, flats[i])  # from the GPU too, where pools live there
            H.ObjectHeader.for_payload(key, digest, body).pack_into(buf)

        sizes = [H.HEADER_BYTES + f.numel() for f in flats]
        try:
            codes = self.client.put([self.name(k) for k, _, _ in items], fill, sizes)
        except ClusterUnavailable:
            self._counters.add("put_failed", len(items))
            raise
        failed = [c for c in codes if c != 0]
        self._counters.add("stored", len(items) - len(failed))
        self._counters.add("bytes_stored", sum(n for n, c in zip(sizes, codes) if c == 0))
        if failed:
            self._counters.add("put_failed", len(failed))
            too_large = " (larger than staging_bytes)" if TOO_LARGE in failed else ""
            codes_seen = sorted(set(failed))
            raise ClusterPutError(f"{len(failed)} of {len(items)} objects not stored{too_large}: codes {codes_seen}")

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> int:
        """Counts the objects present: Mooncake cannot pin after a put (its lease and eviction decide what lives)."""
        return sum(1 for r in self.has(keys, [b"\0" * 16] * len(keys)) if r is Reason.OK)

    def remove(self, keys: Sequence[ObjectKey]) -> int:
        if not keys:
            return 0
        n = self.client.remove([self.name(k) for k in keys])
        self._counters.add("removed", n)
        return n

    def _remove_quietly(self, names: list[str]) -> None:
        try:
            self._counters.add("removed", self.client.remove(names))
        except ClusterError as exc:
            log.info("could not remove %d bad cluster objects (they stay misses): %s", len(names), exc)

    # ----------------------------------------------------------------- state

    @property
    def up(self) -> bool:
        return self._link.up

    def stats(self) -> ClusterStats:
        v = self._counters.values()
        up = self.up
        return ClusterStats(
            up=up,
            why_down="" if up else self._link.why,
            misses=self._counters.misses(),
            lookup_latency=self._lookup_latency.snapshot(),
            load_latency=self._load_latency.snapshot(),
            **v,
        )

    def close(self) -> None:
        self._janitor.shutdown(wait=True)
        self._link.close()
