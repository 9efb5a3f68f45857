"""The cluster tier as a user gets it (issue 40): `kvtier serve` nodes whose `[cluster]` table names only the
cluster (no `write_through`): engines' state groups reach the other node, a form the local store refuses goes
down once per object, and health follows a master that dies and comes back."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from kvtier.client import Client, NotDurable
from kvtier.core.forms import CacheForm, GroupKind, Reason
from kvtier.core.profile import load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.integrations.daemon_store import DaemonStore
from kvtier.wire import Connection
from support.cluster_nodes import cluster_stats, cluster_toml, start_node, wait_for, wait_written_through
from support.daemon import DaemonProc, child_env
from support.mooncake_loopback import MooncakeCluster
from support.workload import caches_for, tokens_for

PROFILE = load_profile("ref-tiny")
DIGEST = bytes(range(16))
OBJ = 4096
# Engine cache groups as the integrations name them: vLLM DSV4's packed history group, its SWA and
# compressor-state groups; SGLang's ALL_PAGES pools (history) and TRAILING_PAGES pools (state).
ENGINES = {
    "vllm": (
        VersionKey("vllm/dsv4-test", "xxh3_128:01", "vllm-abi", "c4", "idx1", "fp8;chunk=256"),
        [("vllm.g0.c4", CacheForm.COMPRESSED), ("vllm.g1.swa", CacheForm.SWA), ("vllm.g2.state", CacheForm.TAIL)],
    ),
    "sglang": (
        VersionKey("sglang/dsv4-test", "xxh3_128:02", "sglang-abi", "c4", "idx1", "fp8;page=64"),
        [
            ("sgl.all.kv", CacheForm.COMPRESSED),
            ("sgl.all.idx", CacheForm.INDEXER),
            ("sgl.trail.swa", CacheForm.SWA),
            ("sgl.trail.state", CacheForm.TAIL),
        ],
    ),
}
BLOCKS, CHECKPOINTS = 8, (3, 7)  # history for every block; state at the checkpoint blocks, as engines store it


def _objects(engine: str) -> list[tuple[ObjectKey, torch.Tensor, bytes]]:
    vkey, groups = ENGINES[engine]
    out = []
    for name, form in groups:
        blocks = range(BLOCKS) if form.kind is GroupKind.HISTORY else CHECKPOINTS
        for b in blocks:
            seed = hash((engine, name, b)) & 0xFFFF_FFFF
            payload = torch.randint(0, 256, (OBJ,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
            out.append((ObjectKey(vkey.namespace, b.to_bytes(16, "little"), name, form), payload, DIGEST))
    return out


def test_engines_state_groups_reach_the_other_node_by_default(own_cluster: MooncakeCluster, tmp_path: Path) -> None:
    """vLLM- and SGLang-style groups through the daemons' raw tier ops, no `write_through` key: node 2 has and
    loads, bitwise, every object node 1 stored, the state objects of its last checkpoint included (with a
    history-only write-through node 2's hit was 0 tokens)."""
    node1 = start_node(tmp_path, "node1", own_cluster)
    node2 = start_node(tmp_path, "node2", own_cluster)
    try:
        assert "write_through" not in node1.config.read_text()
        total = 0
        for engine, (vkey, groups) in ENGINES.items():
            items = _objects(engine)
            store = DaemonStore(node1.socket, vkey, groups, len(items) * OBJ)
            try:
                store.store_many(items)
            finally:
                store.close()
            total += len(items)
        wait_written_through(node1, total)
        for engine, (vkey, groups) in ENGINES.items():
            items = _objects(engine)
            store = DaemonStore(node2.socket, vkey, groups, len(items) * OBJ)
            try:
                keys = [k for k, _, _ in items]
                assert store.has(keys, [DIGEST] * len(keys)) == [Reason.OK] * len(keys), engine
                outs = [torch.zeros(OBJ, dtype=torch.uint8) for _ in items]
                got = store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
                assert got == [Reason.OK] * len(keys), engine
                assert all(torch.equal(o, p) for o, (_, p, _) in zip(outs, items)), engine
                last = [k for k in keys if k.form.kind is GroupKind.STATE and k.block_hash[0] == CHECKPOINTS[-1]]
                assert {k.form for k in last} == {f for _, f in groups if f.kind is GroupKind.STATE}
            finally:
                store.close()
        s2 = cluster_stats(node2)
        assert s2["cluster_hits"] == total and s2["local_hits"] == 0, s2
        assert node2.terminate() == 0 and node1.terminate() == 0
    finally:
        node1.close()
        node2.close()


def test_a_form_the_store_refuses_goes_down_once_per_object(own_cluster: MooncakeCluster, tmp_path: Path) -> None:
    """The swa quota holds no record: every write-back pass (each flush, the daemon's own retries) tries the
    swa objects again, whole batches then one by one. The cluster gets one put per distinct object decided."""
    node = DaemonProc(tmp_path, extra_toml=cluster_toml(own_cluster) + '[store.quota_bytes]\nswa = "4KiB"\n')
    try:
        distinct = 0
        with Client(node.socket) as c:
            c.attach("ref-tiny")
            for seed in range(3):
                caches = caches_for(PROFILE, seed, 3)
                c.offload(tokens_for(seed, 3, PROFILE.hash_block_tokens), caches)
                distinct += sum(len(v) for v in caches.values())
            for _ in range(3):  # three more passes over the refused objects
                with pytest.raises(NotDurable, match="swa"):
                    c.flush(timeout_s=20)
        stats = wait_written_through(node, distinct)
        assert stats["queued"] == stats["written_through"] == distinct, stats
        assert stats["cluster"]["stored"] + stats["cluster"]["put_failed"] == distinct, stats["cluster"]
        with Connection(node.socket, timeout_s=10.0, name="cluster test") as conn:
            assert conn.stats().store["failed_passes"] >= 3
    finally:
        node.close()


def _status(node) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", "--socket", str(node.socket)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )


def _cluster_up_gauge(node) -> str:
    with Connection(node.socket, timeout_s=10.0, name="cluster test") as conn:
        address = conn.stats().daemon.metrics
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("kvtier_cluster_up ")]
    return line


def _until(cond, timeout: float) -> float:
    """Seconds until `cond()` held (polled every 20 ms); fails past `timeout`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(0.02)  # polling a real condition
    return time.monotonic() - t0


@pytest.mark.parametrize("load", ["idle", "busy"])
def test_health_says_down_within_the_bound_and_up_again(
    own_cluster: MooncakeCluster, tmp_path: Path, load: str
) -> None:
    """Master SIGKILLed with the node idle (only the probe asks) or busy (an engine looking up prefixes the
    cluster is asked about): the daemon's own view, `kvtier status` (exit 1, degraded) and `kvtier_cluster_up`
    say down within lookup_timeout_s + probe_s; a restarted master brings them up within the same bound."""
    lookup_s, probe_s = 0.5, 0.5
    bound = lookup_s + probe_s
    slack = 0.5  # the test's own polling and the stats round trip on a loaded 2-core machine
    node = start_node(tmp_path, "node", own_cluster, lookup_timeout_s=lookup_s, probe_s=probe_s)
    stop = threading.Event()
    asked = [0]

    def engine() -> None:
        with Client(node.socket) as c:
            c.attach("ref-tiny")
            seed = 1000
            while not stop.is_set():
                c.lookup(tokens_for(seed, 2, PROFILE.hash_block_tokens))  # unknown here: the cluster is asked
                asked[0] += 1
                seed += 1

    def up() -> bool:
        return cluster_stats(node)["cluster"]["up"]

    worker = threading.Thread(target=engine, daemon=True) if load == "busy" else None
    try:
        _until(up, 30)
        if worker is not None:
            worker.start()
            wait_for("the engine's lookups", lambda: asked[0] > 5, 30)
        own_cluster.masters[0].kill(signal.SIGKILL)
        took_down = _until(lambda: not up(), bound + slack)
        doc = cluster_stats(node)["cluster"]
        assert doc["why_down"], doc
        out = _status(node)
        assert out.returncode == 1 and "cluster    DOWN" in out.stdout, out.stdout
        assert "health     degraded: cluster down" in out.stdout, out.stdout
        assert _cluster_up_gauge(node) == "kvtier_cluster_up 0.0"
        if worker is not None:
            before = asked[0]
            wait_for("lookups keep being answered while the cluster is down", lambda: asked[0] > before + 5, 30)

        own_cluster.start_master()  # on the same port: the node's client reconnects by itself
        took_up = _until(up, bound + slack)
        out = _status(node)
        assert "cluster    up" in out.stdout and "health     ok" in out.stdout and out.returncode == 0, out.stdout
        assert _cluster_up_gauge(node) == "kvtier_cluster_up 1.0"
        print(f"{load}: down after {took_down:.2f} s, up after {took_up:.2f} s (bound {bound} s)")
    finally:
        stop.set()
        if worker is not None:
            worker.join(30)
        node.close()
