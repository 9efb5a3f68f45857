"""TierChain (real DiskStore + real Mooncake): two nodes share prefixes through the cluster; faults stay misses."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from kvtier.cluster import ClusterTier
from kvtier.cluster.chain import TierChain
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, StoreFull
from support.cluster_nodes import cluster_config
from support.store_helpers import DIGEST, VK, make_key, make_payload


def _node(tmp_path, name: str, cluster, **kw) -> tuple[DiskStore, TierChain]:
    disk = DiskStore(str(tmp_path / name), writer=True)
    disk.register_namespace(VK)
    cfg = cluster_config(cluster, **kw)
    return disk, TierChain(disk, ClusterTier(cfg), cfg)


def _items(tag: str, n: int) -> list:
    ns = VK.namespace
    out = [(make_key(ns, f"{tag}-{i}"), make_payload(f"{tag}-{i}", 30_000), DIGEST) for i in range(n)]
    out.append((make_key(ns, f"{tag}-swa", "swa", CacheForm.SWA), make_payload(f"{tag}-swa", 8_000), DIGEST))
    return out


def _load(tier, items) -> tuple[list[Reason], list[torch.Tensor]]:
    outs = [torch.zeros_like(p) for _, p, _ in items]
    return tier.load_into([LoadRequest(k, o, d) for (k, _, d), o in zip(items, outs)]), outs


def test_second_node_restores_from_the_cluster_and_promotes(shared_cluster, tmp_path) -> None:
    disk1, node1 = _node(tmp_path, "n1", shared_cluster)
    disk2, node2 = _node(tmp_path, "n2", shared_cluster)
    try:
        items = _items("share", 5)
        keys, digests = [k for k, _, _ in items], [DIGEST] * len(items)
        node1.store_many(items)
        assert disk1.has(keys, digests) == [Reason.OK] * len(items)  # durable locally when store_many returned
        assert node1.drain(10)
        # the default write-through: history and the swa state object, so node 2 has a usable hit
        assert node2.has(keys, digests) == [Reason.OK] * 6
        reasons, outs = _load(node2, items)
        assert reasons == [Reason.OK] * 6 and all(torch.equal(o, p) for o, (_, p, _) in zip(outs, items))
        assert node2.drain(10)
        assert disk2.has(keys, digests) == [Reason.OK] * 6  # promoted: the next restore is local
        s1, s2 = node1.stats(), node2.stats()
        assert s1.written_through == 6 and s1.cluster.stored == 6
        assert s2.cluster_hits == 6 and s2.promoted == 6 and s2.dropped == 0
    finally:
        for chain, disk in ((node1, disk1), (node2, disk2)):
            chain.close()
            disk.close()


def test_a_refused_form_goes_down_once_per_object_however_often_it_is_retried(shared_cluster, tmp_path) -> None:
    """The local store refuses the swa form (its quota); the write-back retries it every pass, in batches and
    then one by one, as the persister does. The cluster gets one put per distinct object decided (accepted
    or refused), and the counters count those objects, not the attempts."""
    disk, chain = _node(tmp_path, "q", shared_cluster)
    try:
        disk.set_limits(1 << 30, {CacheForm.SWA: 4096})  # no 8 kB swa object ever fits
        items = _items("refused", 3)  # 3 compressed, 1 swa
        swa_items = [*items[3:], *[_items(f"refused-swa{i}", 0)[0] for i in range(2)]]  # 3 distinct swa objects
        chain.store_many(items[:3])
        for _ in range(4):  # four passes of the write-back: the whole batch, then each object alone
            with pytest.raises(StoreFull):
                chain.store_many(swa_items)
            for it in swa_items:
                with pytest.raises(StoreFull):
                    chain.store_many([it])
        chain.store_many(items[:3])  # accepted objects stored again (a re-offload): not sent again either
        assert chain.drain(10)
        stats = chain.stats()
        distinct = 3 + len(swa_items)
        assert stats.queued == stats.written_through == distinct, stats
        assert stats.cluster.stored + stats.cluster.put_failed == distinct, stats.cluster
        assert disk.has([k for k, _, _ in swa_items], [DIGEST] * 3) == [Reason.MISSING] * 3
        assert chain.cluster.has([k for k, _, _ in swa_items], [DIGEST] * 3) == [Reason.OK] * 3  # others can use them
        chain.remove([k for k, _, _ in items[:1]])  # removed, then stored again: it goes down again
        chain.store_many(items[:1])
        assert chain.drain(10) and chain.stats().written_through == distinct + 1
    finally:
        chain.close()
        disk.close()


def test_a_loads_later_requests_are_asked_of_the_cluster_too(shared_cluster, tmp_path) -> None:
    """A load handed its first requests and `more` (as a recovery into the pools hands them): the local store asks
    for the rest once its first reads are out, and what it misses of them comes from the cluster, in order."""
    disk1, node1 = _node(tmp_path, "m1", shared_cluster)
    disk2, node2 = _node(tmp_path, "m2", shared_cluster)
    try:
        items = _items("later", 5)[:5]
        node1.store_many(items)
        assert node1.drain(10)
        node2.store_many(items[:1])  # one of the first is local to node 2 as well
        outs = [torch.zeros_like(p) for _, p, _ in items]
        requests = [LoadRequest(k, o, d) for (k, _, d), o in zip(items, outs)]
        asked = []
        reasons = node2.load_into(requests[:2], lambda: asked.append(1) or requests[2:])
        assert reasons == [Reason.OK] * 5 and asked == [1]
        assert all(torch.equal(o, p) for o, (_, p, _) in zip(outs, items))
        stats = node2.stats()
        assert stats.local_hits == 1 and stats.cluster_hits == 4
    finally:
        for chain, disk in ((node1, disk1), (node2, disk2)):
            chain.close()
            disk.close()


def test_full_backlog_drops_without_blocking(own_cluster, tmp_path) -> None:
    """The master stopped, the first write-through hangs in its put; offloads still return at once, durable
    locally, and what does not fit beside it in the backlog is dropped and counted."""
    disk, chain = _node(tmp_path, "n", own_cluster, queue_bytes=40_000)
    try:
        items = _items("drop", 6)  # 6 x 30 kB and one 8 kB: beside the first, only the 8 kB one fits
        with own_cluster.masters[0].stopped():  # a stop shorter than the master's client_ttl loses nothing
            t0 = time.monotonic()
            for it in items:
                chain.store_many([it])
            assert time.monotonic() - t0 < 5
        assert chain.drain(15)
        stats = chain.stats()
        assert stats.dropped == 5 and stats.written_through + stats.background_failed == 2, stats
        assert disk.has([k for k, _, _ in items], [DIGEST] * len(items)) == [Reason.OK] * len(items)
    finally:
        chain.close()
        disk.close()


def test_master_down_serves_local_hits_and_misses_the_rest(own_cluster, tmp_path) -> None:
    disk1, node1 = _node(tmp_path, "n1", own_cluster)
    disk2, node2 = _node(tmp_path, "n2", own_cluster)
    try:
        shared, local = _items("remote", 3)[:3], _items("local", 3)[:3]
        node1.store_many(shared)
        assert node1.drain(10)
        node2.store_many(local)
        own_cluster.masters[0].kill(signal.SIGKILL)
        both = shared + local
        t0 = time.monotonic()
        assert node2.has([k for k, _, _ in both], [DIGEST] * 6) == [Reason.MISSING] * 3 + [Reason.OK] * 3
        reasons, outs = _load(node2, both)
        assert reasons == [Reason.MISSING] * 3 + [Reason.OK] * 3
        assert all(torch.equal(outs[i], both[i][1]) for i in range(3, 6))
        assert time.monotonic() - t0 < node2.cfg.lookup_timeout_s + node2.cfg.load_timeout_s + 1
    finally:
        for chain, disk in ((node1, disk1), (node2, disk2)):
            chain.close(timeout=0.5)
            disk.close()
