"""Cross-node restore through the cluster tier vs a local-disk restore of the same objects; prints one JSON object.

Tier level (phase 1 of issue 16; the daemon-level comparison comes with the daemon integration):

1. a loopback Mooncake cluster starts (a master, two holders);
2. node 1 stores `--objects` objects of `--object-bytes` into its ClusterTier (and the same into a DiskStore);
3. node 2 (a second Mooncake client, i.e. another node's view) loads them all through its ClusterTier, verified
   (header + xxh3 checksum) into a pool-like buffer: `cluster_gbps`;
4. the DiskStore, its files evicted from the page cache before each round, loads the same objects:
   `disk_gbps`. `ratio` = cluster_gbps / disk_gbps.

On one machine the "network" is loopback TCP: `loopback_gbps` (one TCP stream, measured in the same run) is
the ceiling a cluster restore can reach here; real nodes are bound by their NIC (or RDMA) instead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # support.mooncake

from bench.pagecache import drop_cache_tree
from kvtier.cluster import ClusterConfig, ClusterTier
from kvtier.core import CacheForm, VersionKey
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DiskStore
from support.mooncake_loopback import mooncake_cluster, unavailable

DIGEST = b"L" * 16
VK = VersionKey("bench-cluster", "w0", "abi-1", "comp-1", "idx-1", "fp8")


def loopback_gbps(nbytes: int = 512 << 20) -> float:
    """One TCP stream over loopback, sender and receiver in this process (threads)."""
    server = socket.create_server(("127.0.0.1", 0))
    chunk = bytes(4 << 20)

    def send() -> None:
        with socket.create_connection(server.getsockname()) as s:
            for _ in range(nbytes // len(chunk)):
                s.sendall(chunk)

    sender = threading.Thread(target=send)
    t0 = time.perf_counter()
    sender.start()
    conn, _ = server.accept()
    buf, got = bytearray(4 << 20), 0
    with conn:
        while got < nbytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
    sender.join()
    server.close()
    return got / (time.perf_counter() - t0) / 1e9


def _load(tier, keys: list[ObjectKey], outs: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    reasons = tier.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
    elapsed = time.perf_counter() - t0
    if any(r.value for r in reasons):
        misses = tier.stats().misses if hasattr(tier, "stats") and callable(tier.stats) else {}
        raise SystemExit(f"bench/cluster: a load failed: {sorted({r.label for r in reasons})} {misses}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=128)
    ap.add_argument("--object-bytes", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(json.dumps({"skipped": why}))
        return
    total = args.objects * args.object_bytes
    g = torch.Generator().manual_seed(7)
    payloads = [
        torch.randint(0, 256, (args.object_bytes,), dtype=torch.uint8, generator=g) for _ in range(args.objects)
    ]
    keys = [ObjectKey(VK.namespace, i.to_bytes(16, "big"), "c4", CacheForm.COMPRESSED) for i in range(args.objects)]
    outs = [torch.empty_like(p) for p in payloads]
    with (
        tempfile.TemporaryDirectory() as tmp,
        mooncake_cluster(pathlib.Path(tmp) / "mc", segment_bytes=total + (64 << 20), lease_ms=5000) as mc,
    ):
        cfg = ClusterConfig(
            enabled=True, master=mc.master, metadata=mc.metadata, staging_bytes=64 << 20, load_timeout_s=60
        )
        node1, node2 = ClusterTier(cfg), ClusterTier(cfg)
        t0 = time.perf_counter()
        node1.store_many(list(zip(keys, payloads, [DIGEST] * len(keys))))
        put_s = time.perf_counter() - t0
        cluster_s = min(_load(node2, keys, outs) for _ in range(args.repeat))
        assert all(torch.equal(o, p) for o, p in zip(outs, payloads))
        node1.close()
        node2.close()
        disk = DiskStore(str(pathlib.Path(tmp) / "disk"), writer=True)
        disk.register_namespace(VK)
        disk.store_many(list(zip(keys, payloads, [DIGEST] * len(keys))))
        disk_s = []
        for _ in range(args.repeat):
            drop_cache_tree(disk.root)
            disk_s.append(_load(disk, keys, outs))
        disk.close()
    link = loopback_gbps()
    cluster_gbps, disk_gbps = total / cluster_s / 1e9, total / min(disk_s) / 1e9
    print(
        json.dumps(
            {
                "objects": args.objects,
                "object_bytes": args.object_bytes,
                "total_bytes": total,
                "cluster_put_gbps": round(total / put_s / 1e9, 3),
                "cluster_restore_gbps": round(cluster_gbps, 3),
                "disk_restore_gbps": round(disk_gbps, 3),
                "ratio": round(cluster_gbps / disk_gbps, 3),
                "loopback_gbps": round(link, 3),
                "cluster_vs_link": round(cluster_gbps / link, 3),
                "note": "tier level: ClusterTier vs DiskStore load_into, verified; the link is loopback TCP",
            }
        )
    )


if __name__ == "__main__":
    main()
