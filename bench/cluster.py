"""Cross-node restore through the cluster vs a local-disk restore of the same prefix; prints one JSON object.

Daemon level (`daemon`), the reference model through two real `kvtier serve` daemons on one loopback Mooncake
cluster (a master, two holders):

1. engine A on node 1 prefills `--tokens` tokens and offloads them (durable on node 1's disk, written through
   to the cluster);
2. engine B on node 2 (empty pool and store, `promote` off) restores the prefix from the cluster through its
   daemon: lookup (local index, then one batched existence call), load (gets, header + xxh3 verified);
3. node 1 is restarted (pools empty) and its store's page cache dropped; engine B' on node 1 restores the
   same prefix from local disk. Steps 2-3 run `--repeat` times (node 2 restarted too); each time's best counts.

`gbps` = bytes loaded / load seconds; `ratio` = cluster gbps / disk gbps; `restore_ratio` = disk restore_s /
cluster restore_s (lookup + load + read + rebuild). Both restores must continue bitwise alike.

Tier level (`tier`): a ClusterTier of a second client loads `--objects` x `--object-bytes` verified, vs a
DiskStore with its page cache dropped (no daemon, no model).

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

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # support.mooncake

from bench import cluster_link
from bench.pagecache import drop_cache_tree
from kvtier.client import Client
from kvtier.cluster import ClusterConfig, ClusterTier
from kvtier.core import CacheForm, VersionKey
from kvtier.core.forms import GroupKind
from kvtier.core.profile import load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.refmodel import RefModel
from kvtier.refmodel.demo import DemoDaemon, pool_budgets, settle_pages
from kvtier.refmodel.engine import RefEngine, RestoreResult, checkpoint_policy
from kvtier.store import DiskStore
from support.cluster_nodes import cluster_stats, cluster_toml, wait_written_through
from support.mooncake_loopback import mooncake_cluster, unavailable

DIGEST = b"L" * 16
VK = VersionKey("bench-cluster", "w0", "abi-1", "comp-1", "idx-1", "fp8")
CHECKPOINT_EVERY = 16  # hash blocks between state checkpoints (the engine's default, as in bench/restore.py)


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


def tier_level(args: argparse.Namespace, tmp: pathlib.Path) -> dict:
    """ClusterTier (another client) vs DiskStore load_into of the same objects, verified."""
    total = args.objects * args.object_bytes
    g = torch.Generator().manual_seed(7)
    payloads = [
        torch.randint(0, 256, (args.object_bytes,), dtype=torch.uint8, generator=g) for _ in range(args.objects)
    ]
    keys = [ObjectKey(VK.namespace, i.to_bytes(16, "big"), "c4", CacheForm.COMPRESSED) for i in range(args.objects)]
    outs = [torch.empty_like(p) for p in payloads]
    with mooncake_cluster(tmp / "mc", segment_bytes=total + (64 << 20), lease_ms=5000) as mc:
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
    disk = DiskStore(str(tmp / "disk"), writer=True)
    disk.register_namespace(VK)
    disk.store_many(list(zip(keys, payloads, [DIGEST] * len(keys))))
    disk_s = []
    for _ in range(args.repeat):
        drop_cache_tree(disk.root)
        disk_s.append(_load(disk, keys, outs))
    disk.close()
    cluster_gbps, disk_gbps = total / cluster_s / 1e9, total / min(disk_s) / 1e9
    return {
        "objects": args.objects,
        "object_bytes": args.object_bytes,
        "cluster_put_gbps": round(total / put_s / 1e9, 3),
        "cluster_restore_gbps": round(cluster_gbps, 3),
        "disk_restore_gbps": round(disk_gbps, 3),
        "ratio": round(cluster_gbps / disk_gbps, 3),
    }


def _node(root: pathlib.Path, profile, pools: dict[str, int], mc, **cluster: object) -> DemoDaemon:
    """A `kvtier serve` on `root` whose chain ends in the loopback cluster `mc`."""
    root.mkdir(parents=True)
    node = DemoDaemon(root, profile, pools)
    big = dict(staging_bytes="64MiB", transfer_buffer_bytes="64MiB", lookup_timeout_s=5.0, load_timeout_s=60.0)
    node.config.write_text(node.config.read_text() + cluster_toml(mc, **big, put_timeout_s=60.0, **cluster))
    return node


def _restore(node: DemoDaemon, model: RefModel, tokens) -> tuple[RestoreResult, dict]:
    """Start `node` (empty pools), restore `tokens` through it, stop it; the result and its cluster stats."""
    node.start()
    settle_pages(node.socket)  # its pools as they stay: moved onto huge pages where the host does that after start
    try:
        with Client(node.socket) as c:
            c.attach(model.profile.name)
            got = RefEngine(c, model, checkpoint_every=CHECKPOINT_EVERY).restore_and_continue(tokens)
        return got, cluster_stats(node)
    finally:
        node.stop(90.0)


def _side(best: RestoreResult) -> dict:
    return {
        "hit_tokens": best.hit_tokens,
        "loaded_objects": best.loaded_objects,
        "bytes": best.bytes_from_disk,
        "lookup_s": round(best.lookup_s, 4),
        "load_s": round(best.load_s, 4),
        "restore_s": round(best.restore_s, 4),
        "gbps": round(best.bytes_from_disk / best.load_s / 1e9, 3),
    }


def _write_through_cost(profile, tokens: int, wrote: dict, seconds: float) -> dict:
    """What the default write-through sent for one prefix (measured), and the share of it that is state objects
    (from the profile's geometry: history per block, state per checkpoint, the engine's checkpoint policy)."""
    h = profile.hash_block_tokens
    history = sum(g.object_bytes(h) for g in profile.groups if g.kind is GroupKind.HISTORY) * (tokens // h)
    per_cp = sum(g.object_bytes(h) * g.blocks_needed(h) for g in profile.groups if g.kind is GroupKind.STATE)
    state = per_cp * len(checkpoint_policy(tokens, h, CHECKPOINT_EVERY))
    return {
        "objects": wrote["written_through"],
        "bytes": wrote["cluster"]["bytes_stored"],
        "lag_s": round(seconds, 3),
        "state_vs_history_bytes": round(state / history, 3),
    }


def daemon_level(args: argparse.Namespace, tmp: pathlib.Path) -> dict:
    """Engine B on node 2 restoring node 1's prefix from the cluster, vs node 1 restoring it from its disk."""
    torch.set_num_threads(1)
    profile = load_profile(args.profile)
    model = RefModel(profile)
    tokens = np.random.default_rng(args.tokens).integers(0, model.config.vocab_size, args.tokens + 16, dtype=np.int64)
    pools = pool_budgets(profile, args.tokens, CHECKPOINT_EVERY)
    with mooncake_cluster(tmp / "mc", segment_bytes=args.segment_bytes, lease_ms=5000) as mc:
        node1 = _node(tmp / "node1", profile, pools, mc)
        node2 = _node(tmp / "node2", profile, pools, mc, promote=False)
        node1.start()
        try:
            with Client(node1.socket) as c:
                c.attach(profile.name)
                off = RefEngine(c, model, checkpoint_every=CHECKPOINT_EVERY).prefill_and_offload(
                    tokens[: args.tokens], durable=True
                )
            if off.refused or not off.persisted:
                raise SystemExit(f"bench/cluster: offload incomplete (refused {off.refused})")
            t0 = time.perf_counter()
            wrote = wait_written_through(node1, off.written, timeout=600)
            through_s = time.perf_counter() - t0  # after the durable offload returned: the background's lag
            if wrote["dropped"] or wrote["background_failed"]:
                raise SystemExit(f"bench/cluster: write-through incomplete: {wrote}")
        finally:
            node1.stop(90.0)
        cluster, disk = [], []
        for _ in range(args.repeat):
            got, stats = _restore(node2, model, tokens)
            if stats["local_hits"] or not stats["cluster_hits"]:
                raise SystemExit(f"bench/cluster: node 2 did not restore from the cluster: {stats}")
            cluster.append(got)
            drop_cache_tree(node1.root / "store")
            disk.append(_restore(node1, model, tokens)[0])
    c, d = min(cluster, key=lambda r: r.load_s), min(disk, key=lambda r: r.load_s)
    if c.hit_tokens != d.hit_tokens or not torch.equal(c.logits, d.logits):
        raise SystemExit("bench/cluster: the cluster and disk restores continue differently")
    out = {"profile": profile.name, "tokens": args.tokens, "cluster": _side(c), "disk": _side(d)}
    out["write_through"] = _write_through_cost(profile, args.tokens, wrote, through_s)
    out["ratio"] = round(out["cluster"]["gbps"] / out["disk"]["gbps"], 3)
    out["restore_ratio"] = round(d.restore_s / c.restore_s, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="ref-tiny")
    ap.add_argument("--tokens", type=int, default=8192, help="Prompt tokens node 1 offloads and node 2 restores.")
    ap.add_argument("--segment-bytes", type=int, default=512 << 20, help="Each holder's share of the cluster.")
    ap.add_argument("--objects", type=int, default=128, help="Tier level: objects.")
    ap.add_argument("--object-bytes", type=int, default=1 << 20, help="Tier level: bytes per object.")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-tier", action="store_true", help="Only the daemon-level comparison.")
    ap.add_argument("--link", action="store_true", help="Also restore across two network namespaces (root).")
    cluster_link.add_args(ap)
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(json.dumps({"skipped": why}))
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-cluster-", dir="/var/tmp") as tmp:
        daemon = daemon_level(args, pathlib.Path(tmp))
        tier = None if args.skip_tier else tier_level(args, pathlib.Path(tmp))
    link = loopback_gbps()
    daemon["cluster_vs_link"] = round(daemon["cluster"]["gbps"] / link, 3)
    across = cluster_link.link_level(args) if args.link else None
    print(
        json.dumps(
            {
                "daemon": daemon,
                "tier": tier,
                "link": across,
                "loopback_gbps": round(link, 3),
                "note": "one machine: the cluster's link is loopback TCP (loopback_gbps is its ceiling here), and "
                "the master, holders, both daemons and the engines share its cores",
            }
        )
    )


if __name__ == "__main__":
    main()
