"""Mooncake HA (two masters electing over etcd): the leader killed, the cluster tier serves again within 20 s."""

from __future__ import annotations

import shutil
import signal
import time

import pytest
import torch

from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest
from support.mooncake_loopback import MooncakeCluster
from support.store_helpers import DIGEST, make_key, make_payload


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


def test_leader_killed_hits_again_within_20s(ha_cluster: MooncakeCluster, make_tier) -> None:
    tier = make_tier(ha_cluster, replicas=2)
    items = [(make_key(b"H" * 16, f"ha-{i}"), make_payload(f"ha-{i}", 16_000), DIGEST) for i in range(8)]
    tier.store_many(items)

    def served() -> bool:
        outs = [torch.zeros_like(p) for _, p, _ in items]
        reasons = tier.load_into([LoadRequest(k, o, d) for (k, _, d), o in zip(items, outs)])
        assert all(torch.equal(o, p) for r, o, (_, p, _) in zip(reasons, outs, items) if r is Reason.OK)
        return reasons == [Reason.OK] * len(items)

    assert served()
    ha_cluster.masters[0].kill(signal.SIGKILL)  # the first master started is the one that won the election
    t0 = time.monotonic()
    while not served():
        assert time.monotonic() - t0 < 20, f"no failover within 20 s: {tier.stats().misses}"
        time.sleep(0.2)  # polling a real condition
