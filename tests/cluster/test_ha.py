"""Mooncake HA (two masters electing over etcd) under two kvtier daemons (nodes): the leader killed, node 2
restores from the cluster again within 20 s."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from kvtier.client import Client
from support.cluster_nodes import FAULT_TUNING, cluster_stats, start_node, wait_for, wait_written_through
from support.e2e_harness import H, Oracle, prompt, run_engine, save_prompts
from support.mooncake_loopback import MooncakeCluster


@pytest.fixture
def ha_cluster(mooncake_ready: None, tmp_path) -> MooncakeCluster:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian etcd-server): the HA failover test needs it")
    cluster = MooncakeCluster(tmp_path / "mooncake-ha")
    try:
        cluster.start_etcd()
        cluster.start_master(ha=True)
        cluster.start_master(ha=True)
        for _ in range(2):
            cluster.start_holder(master=f"etcd://{cluster.etcd_endpoint}")
        yield cluster
    finally:
        cluster.close()


BLOCKS = 8  # a prefix of two state checkpoints


def test_two_nodes_leader_killed_node2_hits_again_within_20s(ha_cluster: MooncakeCluster, tmp_path: Path) -> None:
    """Two daemons on HA masters: node 1 writes a prefix through; the leader is killed; node 2 (nothing local)
    restores the whole prefix from the cluster within 20 s, and its engine continues bitwise; node 1 writes
    through to the new leader."""
    tokens = prompt(61, BLOCKS * H + 3)
    work = tmp_path / "work"
    work.mkdir()
    save_prompts(work, {"p61": tokens, "p62": prompt(62, BLOCKS * H + 3)})
    node1 = start_node(tmp_path, "node1", ha_cluster, **FAULT_TUNING)
    node2 = start_node(tmp_path, "node2", ha_cluster, promote=False, **FAULT_TUNING)
    client = Client(node2.socket, name="ha test")
    try:
        before = run_engine(node1, work, "offload", "p61")["p61"]["written"]
        wait_written_through(node1, before)
        client.attach("ref-tiny")
        ha_cluster.masters[0].kill(signal.SIGKILL)  # the first master started is the one that won the election

        def restored() -> bool:  # a lookup and a load through node 2, as an engine makes them
            result = client.lookup(tokens)
            try:
                client.load(result)
                return result.hit_tokens == BLOCKS * H
            finally:
                client.release(result)

        wait_for("node 2 restores from the cluster after the leader's death", restored, 20)
        stats = cluster_stats(node2)
        assert stats["cluster_hits"] > 0 and stats["local_hits"] == 0, stats
        got = run_engine(node2, work, "continue", "p61")["p61"]  # from node 2's pool now: the bytes, bitwise
        assert got["hit_tokens"] == BLOCKS * H, got
        Oracle().check_file(work, "p61", tokens, got["hit_tokens"])
        # node 1, idle through the failover, writes through to the new leader (and then closes in time: a Mooncake
        # client that never reached the new leader can take about 30 s to close)
        after = run_engine(node1, work, "offload", "p62")["p62"]["written"]
        wait_written_through(node1, before + after)
        # Mooncake's HA client waits out its leader watch on close (up to 30 s, its kViewChangeTimeout): both
        # nodes stop at once
        for node in (node1, node2):
            node.proc.send_signal(signal.SIGTERM)  # once: a second SIGTERM during shutdown ends a daemon at once
        assert [node1.proc.wait(60), node2.proc.wait(60)] == [0, 0]
    finally:
        client.close()
        node1.close()
        node2.close()
