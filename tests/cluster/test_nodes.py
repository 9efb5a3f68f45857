"""Two kvtier daemons as two nodes on one loopback Mooncake cluster (master + 2 holders): engine A prefills and
offloads on node 1, engine B on node 2 (empty pool, empty store) restores from the cluster and continues bitwise
equal to an uninterrupted run; holder, master and object faults turn into misses, never wrong bytes or a hang."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.wire import Connection
from support.cluster_nodes import (
    FAULT_TUNING,
    audit_cli,
    cluster_stats,
    kvtier_cli,
    start_node,
    wait_for,
    wait_written_through,
)
from support.daemon import child_env
from support.e2e_harness import H, Oracle, prompt, run_engine, save_prompts
from support.mooncake_loopback import MooncakeCluster

BLOCKS = 12  # hash blocks per prompt (384 tokens on ref-tiny: checkpoints every 4 blocks)


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle()


def _work(tmp_path: Path, **prompts) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    save_prompts(work, prompts)
    return work


def _offload_on_node1(tmp_path: Path, cluster: MooncakeCluster, work: Path, *names: str, **kw: object):
    """Node 1: engine A prefills and offloads `names`; returns (node, its cluster stats once written through)."""
    node1 = start_node(tmp_path, "node1", cluster, **kw)
    wrote = run_engine(node1, work, "offload", *names)
    assert all(wrote[n]["persisted"] for n in names)
    written = sum(wrote[n]["written"] for n in names)
    return node1, wait_written_through(node1, written)


def _check_metrics_and_status(node, cluster_hits: int) -> None:
    """The per-tier figures reach Prometheus and `kvtier status`."""
    with Connection(node.socket, timeout_s=10.0, name="cluster test") as conn:
        address = conn.stats().daemon.metrics
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    assert f'kvtier_cluster_objects_total{{event="cluster_hits"}} {float(cluster_hits)}' in text
    assert 'kvtier_cluster_latency_seconds_count{op="load"}' in text and "kvtier_cluster_up 1.0" in text
    assert 'kvtier_cluster_bytes_total{dir="loaded"}' in text
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", "--socket", str(node.socket)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    ).stdout
    assert f"cluster    up  hits {cluster_hits} (local disk 0)" in out, out
    assert "  latency  lookup p50 <= " in out, out


@pytest.mark.parametrize("replicas", [2, 1])
def test_node2_restores_from_the_cluster_bitwise_and_survives_a_holder_kill(
    own_cluster: MooncakeCluster, tmp_path: Path, oracle: Oracle, replicas: int
) -> None:
    """replicas 2: after a holder's SIGKILL, node 2 still restores the whole prefix from the cluster.
    replicas 1: the dead holder's objects are misses; node 2 recomputes what it lost, still bitwise."""
    tokens = {"p0": prompt(21, BLOCKS * H + 17), "p1": prompt(22, BLOCKS * H + 9)}
    work = _work(tmp_path, **tokens)
    node1, s1 = _offload_on_node1(tmp_path, own_cluster, work, *tokens, replicas=replicas, **FAULT_TUNING)
    node2 = start_node(tmp_path, "node2", own_cluster, replicas=replicas, **FAULT_TUNING)
    try:
        # the first restore on node 2, with every holder alive: the whole prefix, from the cluster
        got = run_engine(node2, work, "continue", "p0")["p0"]
        assert got["hit_tokens"] == BLOCKS * H, got
        assert got["routes_at_lookup"].get("REUSE", 0) == 0 and got["loaded_objects"] > 0, got
        oracle.check_file(work, "p0", tokens["p0"], got["hit_tokens"])
        s2 = cluster_stats(node2)
        assert s2["cluster_hits"] == got["loaded_objects"] and s2["local_hits"] == 0, s2
        assert s2["cluster"]["bytes_loaded"] > 0 and s2["cluster"]["load_latency"]["counts"]
        wait_for("promotions to node 2's disk", lambda: cluster_stats(node2)["promoted"] >= got["loaded_objects"], 20)
        _check_metrics_and_status(node2, got["loaded_objects"])

        own_cluster.holders[0].kill(signal.SIGKILL)
        # until the master declares the holder dead (client_ttl), loads touching it miss: wait that out
        wait_for("the master unmounted the dead holder", lambda: own_cluster.segments_expired() == 1, 30)
        t0 = time.monotonic()
        got = run_engine(node2, work, "continue", "p1")["p1"]
        assert time.monotonic() - t0 < 60
        oracle.check_file(work, "p1", tokens["p1"], got["hit_tokens"])
        if replicas == 2:
            assert got["hit_tokens"] == BLOCKS * H, got
        else:  # about half the objects were on the dead holder: a shorter hit (maybe none), recomputed bitwise
            assert got["hit_tokens"] < BLOCKS * H, got
            assert cluster_stats(node2)["cluster"]["misses"].get("missing", 0) > 0
        assert node2.terminate() == 0 and node1.terminate() == 0
    finally:
        node1.close()
        node2.close()
    assert s1["cluster"]["stored"] >= s1["written_through"] > 0 and s1["dropped"] == 0


def test_prewarm_restores_from_the_cluster_and_audit_counts_and_checks_it(
    own_cluster: MooncakeCluster, tmp_path: Path, oracle: Oracle
) -> None:
    """`kvtier prewarm` through node 2 loads node 1's prefix from the cluster; `kvtier audit --cluster` counts
    the cluster's objects per namespace and form (the master's listing, and node 2's own index) and verifies
    a sample."""
    tokens = {"p0": prompt(23, BLOCKS * H + 5)}
    work = _work(tmp_path, **tokens)
    node1, s1 = _offload_on_node1(tmp_path, own_cluster, work, "p0")
    node2 = start_node(tmp_path, "node2", own_cluster)
    try:
        manifest = tmp_path / "prewarm.jsonl"
        manifest.write_text(json.dumps({"name": "p0", "profile": "ref-tiny", "tokens": tokens["p0"].tolist()}) + "\n")
        run = kvtier_cli("prewarm", str(manifest), "--socket", str(node2.socket), "--json")
        assert run.returncode == 0, run.stderr
        pre = json.loads(run.stdout)["prefixes"][0]
        assert pre["hit_tokens"] == BLOCKS * H and pre["loaded_objects"] > 0 and pre["pinned"] > 0, pre
        s2 = cluster_stats(node2)
        assert s2["cluster_hits"] == pre["loaded_objects"] and s2["local_hits"] == 0, s2
        got = run_engine(node2, work, "continue", "p0")["p0"]  # served from node 2's pool and disk now
        assert got["hit_tokens"] == BLOCKS * H, got
        oracle.check_file(work, "p0", tokens["p0"], got["hit_tokens"])
        assert cluster_stats(node2)["cluster_hits"] == s2["cluster_hits"]

        # the master's listing: every object node 1 wrote through, one namespace, each sampled object sound
        rc, audit = audit_cli(node1, node1.config, "--sample", "1000")
        assert rc == 0 and audit["source"] == own_cluster.admin.split(";")[0], audit
        (forms,) = audit["namespaces"].values()
        assert sum(t["objects"] for t in forms.values()) == s1["written_through"], audit
        assert audit["sampled"] == s1["written_through"] and audit["verdicts"] == {"ok": audit["sampled"]}, audit
        # no admin server: what node 2's store holds (the promoted copies), each found in the cluster
        wait_for("promotions to node 2's disk", lambda: cluster_stats(node2)["promoted"] >= pre["loaded_objects"], 20)
        local_only = tmp_path / "no-admin.toml"
        local_only.write_text(node2.config.read_text().replace(f'admin = "{own_cluster.admin}"', 'admin = ""'))
        rc, audit = audit_cli(node2, local_only, "--sample", "4")
        assert rc == 0 and audit["source"] == "local index", audit
        (forms,) = audit["namespaces"].values()
        assert sum(t["objects"] for t in forms.values()) >= pre["loaded_objects"], audit
        assert all(t["absent"] == 0 for t in forms.values()) and audit["verdicts"] == {"ok": 4}, audit
        assert node2.terminate() == 0 and node1.terminate() == 0
    finally:
        node1.close()
        node2.close()
