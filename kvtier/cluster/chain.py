"""TierChain: local disk, then the cluster, as one LowerTier (what the daemon holds where it held the DiskStore).

Lookups ask the local index first and the cluster only for what it lacks, in one batched call with a
deadline; loads from the cluster are promoted to local disk in the background; offloads are stored
locally (durable when store_many returns, as before) and written through to the cluster in the background.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from kvtier.cluster.background import BackgroundWriter
from kvtier.cluster.errors import ClusterError
from kvtier.cluster.stats import ChainStats, Counters
from kvtier.cluster.tier import ClusterTier
from kvtier.core.cluster_config import ClusterConfig
from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest, LowerTier, MoreRequests, ObjectKey

log = logging.getLogger(__name__)

# Local answers the cluster may improve on. A retired namespace (stale_version) or a record in another
# layout (abi_mismatch) is this node's verdict on the key itself: the cluster is not asked.
_ASK_CLUSTER = frozenset({Reason.MISSING, Reason.EVICTED, Reason.CORRUPT})
# Keys of objects queued for write-through that the chain remembers (about 100 bytes each): far more than
# a write-back backlog holds, so a retried object is recognised for as long as it can come back.
_SENT_KEYS = 1 << 18


class SentKeys:
    """The last `capacity` keys queued for the cluster, oldest forgotten first (thread-safe)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[ObjectKey, None] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, items: Iterable[tuple[ObjectKey, torch.Tensor, bytes]]) -> list:
        """The items whose keys were not queued before (and are now remembered as queued)."""
        out = []
        with self._lock:
            for it in items:
                if it[0] in self._keys:
                    self._keys.move_to_end(it[0])
                    continue
                self._keys[it[0]] = None
                out.append(it)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
        return out

    def forget(self, keys: Iterable[ObjectKey]) -> None:
        with self._lock:
            for k in keys:
                self._keys.pop(k, None)


class TierChain:
    """has / load_into / store(_many) / pin / remove over `local` then `cluster`."""

    def __init__(self, local: LowerTier, cluster: ClusterTier, cfg: ClusterConfig) -> None:
        self.local = local
        self.cluster = cluster
        self.cfg = cfg
        self._counters = Counters(
            "local_hits", "cluster_hits", "queued", "dropped", "written_through", "promoted", "background_failed"
        )
        self._writer = BackgroundWriter(cfg.queue_bytes, self._counters)
        self._sent = SentKeys(_SENT_KEYS)

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        out = self.local.has(keys, layout_digests)
        self._counters.add("local_hits", out.count(Reason.OK))
        ask = [i for i, r in enumerate(out) if r in _ASK_CLUSTER]
        if ask:
            remote = self.cluster.has([keys[i] for i in ask], [layout_digests[i] for i in ask])
            for i, r in zip(ask, remote):
                if r is Reason.OK:
                    out[i] = r
        return out

    def load_into(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> list[Reason]:
        later: list[Sequence[LoadRequest]] = []

        def forward() -> Sequence[LoadRequest]:
            assert more is not None
            later.append(got := more())  # as it came (a LoadBatch stays one for the local store)
            return got

        out = self.local.load_into(requests, None if more is None else forward)
        self._counters.add("local_hits", out.count(Reason.OK))
        ask = [i for i, r in enumerate(out) if r in _ASK_CLUSTER]
        if not ask:
            return out
        requests = [*requests, *itertools.chain.from_iterable(later)]  # (the cluster is asked from all of them)
        remote = self.cluster.load_into([requests[i] for i in ask])
        got = [i for i, r in zip(ask, remote) if r is Reason.OK]
        for i, r in zip(ask, remote):
            # The cluster's verdict when it had something to say, else the local one (evicted says more than missing).
            if r is not Reason.MISSING:
                out[i] = r
        self._counters.add("cluster_hits", len(got))
        if got and self.cfg.promote:
            items = [(requests[i].key, requests[i].out, requests[i].layout_digest) for i in got]
            self._writer.submit("promoted", self.local.store_many, items)
        return out

    def store(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes) -> None:
        self.store_many([(key, payload, layout_digest)])

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        """Durable locally when it returns (or raises as the local store does); the cluster copy follows later.

        The write-through is queued once the local store has decided, even when it refuses the batch (full):
        the objects are sound, and other nodes can still use them. Each object is queued once: a refused
        object comes back with every retry of the write-back (and again, in smaller batches, when room is
        made), and a put of a key the cluster already holds moves the bytes again for nothing, so the chain
        remembers the keys it queued (the last `_SENT_KEYS`) and queues only the others.
        """
        try:
            self.local.store_many(items)
        finally:
            through = self._sent.first_time(it for it in items if self.cfg.write_through.covers(it[0].form))
            if through and not self._writer.submit("written_through", self.cluster.store_many, through):
                self._sent.forget(k for k, _, _ in through)  # dropped (backlog full): a later retry may send it

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> int:
        """Pins local records only (the cluster cannot pin, ClusterTier.pin), after waiting up to load_timeout_s
        for queued promotions: a prewarm that just loaded objects from the cluster pins their local copies."""
        self._writer.drain(self.cfg.load_timeout_s)
        return self.local.pin(keys, ttl_s)

    def remove(self, keys: Sequence[ObjectKey]) -> int:
        """Removes local records and their cluster copies; returns how many local records existed."""
        n = self.local.remove(keys)
        self._sent.forget(keys)  # stored again later, they go down again
        try:
            self.cluster.remove(keys)
        except ClusterError as exc:
            log.info("cluster copies of %d removed objects stay until evicted: %s", len(keys), exc)
        return n

    def drain(self, timeout: float) -> bool:
        """Wait for the background writes queued so far (tests, shutdown)."""
        return self._writer.drain(timeout)

    def stats(self) -> ChainStats:
        return ChainStats(
            **self._counters.values(), backlog_bytes=self._writer.backlog_bytes, cluster=self.cluster.stats()
        )

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued writes for up to `timeout`, then close the cluster client (the local tier is the caller's)."""
        self._writer.close(timeout)
        self.cluster.close()
