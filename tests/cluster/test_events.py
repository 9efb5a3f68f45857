"""KV events of the tier chain (real DiskStores + real Mooncake): the cluster's copies are announced as
`kvtier_cluster` (REMOTE) when a write-through or a removal returns, and a promotion from the cluster as a
`kvtier_disk` store on the node that promoted it. Read back through each publisher's replay socket."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import zmq

from kvtier.cluster import ClusterTier
from kvtier.cluster.chain import TierChain
from kvtier.core.events_config import EventsConfig
from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest
from kvtier.daemon import kv_events as E
from kvtier.daemon.events import EventPublisher, ObservedCluster
from kvtier.store import DiskStore
from support.cluster_nodes import cluster_config
from support.store_helpers import DIGEST, VK, make_key, make_payload


def _node(tmp_path: Path, name: str, cluster) -> tuple[DiskStore, TierChain, EventPublisher]:
    disk = DiskStore(str(tmp_path / name), writer=True)
    disk.register_namespace(VK)
    events = EventPublisher(
        EventsConfig(endpoint=f"ipc://{tmp_path}/{name}.pub", replay_endpoint=f"ipc://{tmp_path}/{name}.replay")
    )
    events.name_groups(VK.namespace, ["c4"])
    disk.observe(events.disk_changed)
    cfg = cluster_config(cluster)
    return disk, TierChain(disk, ObservedCluster(ClusterTier(cfg), events), cfg), events  # type: ignore[arg-type]


def _history(events: EventPublisher, batches: int) -> list[tuple[str, str, bytes]]:
    """(medium, change, block hash) of every event, from the replay socket once `batches` were sent."""
    deadline = time.monotonic() + 20
    while events.stats().batches < batches:
        assert time.monotonic() < deadline, events.stats()
        time.sleep(0.05)  # polling a condition with a deadline
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(events.replay_endpoint)
    out: list[tuple[str, str, bytes]] = []
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert sock.poll(10_000)
            _, _, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            for ev in E.decode_batch(payload).events:
                change = "stored" if isinstance(ev, E.BlockStored) else "removed"
                assert ev.locality == (E.LOCAL if ev.medium == E.MEDIUM_DISK else E.REMOTE) and ev.group_idx == 0
                out.append((ev.medium, change, bytes(ev.block_hashes[0])))
    finally:
        sock.close(linger=0)
        ctx.term()


def test_write_through_promotion_and_removal_are_announced(shared_cluster, tmp_path: Path) -> None:
    disk1, node1, ev1 = _node(tmp_path, "n1", shared_cluster)
    disk2, node2, ev2 = _node(tmp_path, "n2", shared_cluster)
    try:
        items = [(make_key(VK.namespace, f"ev-{i}"), make_payload(f"ev-{i}", 20_000), DIGEST) for i in range(4)]
        hashes = [k.block_hash for k, _, _ in items]
        node1.store_many(items)
        assert node1.drain(10)
        assert _history(ev1, 2) == [
            *[(E.MEDIUM_DISK, "stored", h) for h in hashes],
            *[(E.MEDIUM_CLUSTER, "stored", h) for h in hashes],
        ]
        outs = [torch.zeros_like(p) for _, p, _ in items]
        assert node2.load_into([LoadRequest(k, o, d) for (k, _, d), o in zip(items, outs)]) == [Reason.OK] * 4
        assert node2.drain(10)
        assert _history(ev2, 1) == [(E.MEDIUM_DISK, "stored", h) for h in hashes]  # promoted; not written through
        node1.remove([k for k, _, _ in items[:2]])
        assert node2.has([k for k, _, _ in items[:2]], [DIGEST] * 2) == [Reason.OK] * 2  # node 2's own copies
        assert _history(ev1, 4)[8:] == [
            *[(E.MEDIUM_DISK, "removed", h) for h in hashes[:2]],
            *[(E.MEDIUM_CLUSTER, "removed", h) for h in hashes[:2]],
        ]
        assert node1.has([k for k, _, _ in items[:2]], [DIGEST] * 2) != [Reason.OK] * 2  # gone from both tiers
    finally:
        for chain, disk, ev in ((node1, disk1, ev1), (node2, disk2, ev2)):
            chain.close()
            disk.observe(None)
            ev.close()
            disk.close()
