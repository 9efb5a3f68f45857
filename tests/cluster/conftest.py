"""Fixtures for the cluster tier: a loopback Mooncake cluster (master + 2 holders) and tiers/chains over it.

Everything here skips, with one line saying why, where Mooncake cannot run (tests/cluster/run.sh installs it).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import pytest

from kvtier.cluster import ClusterTier
from support.cluster_nodes import cluster_config
from support.mooncake_loopback import MooncakeCluster, mooncake_cluster, unavailable


@pytest.fixture(scope="session")
def mooncake_ready() -> None:
    why = unavailable()
    if why and os.environ.get("KVTIER_CLUSTER_REQUIRED") == "1":  # run.sh installed it: a failure, not a skip
        pytest.fail(why)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def shared_cluster(mooncake_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """One cluster for the tests that do not break it."""
    with mooncake_cluster(tmp_path_factory.mktemp("mooncake")) as cluster:
        yield cluster


@pytest.fixture
def own_cluster(mooncake_ready: None, tmp_path: pathlib.Path) -> Iterator[MooncakeCluster]:
    """A cluster of this test's own, to kill or stop parts of."""
    with mooncake_cluster(tmp_path / "mooncake") as cluster:
        yield cluster


@pytest.fixture
def make_tier() -> Iterator:
    """Open ClusterTiers (closed at teardown): make_tier(cluster, **config overrides)."""
    tiers: list[ClusterTier] = []

    def make(cluster: MooncakeCluster, **kw: object) -> ClusterTier:
        tiers.append(ClusterTier(cluster_config(cluster, **kw)))
        return tiers[-1]

    yield make
    for tier in tiers:
        tier.close()
