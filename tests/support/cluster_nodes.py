"""Clients of a loopback Mooncake cluster (support/mooncake_loopback.py): ClusterConfigs for tiers, and kvtier
daemons as cluster nodes, each a real `kvtier serve` with its own store and socket and a `[cluster]` table."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.cluster import ClusterConfig
from kvtier.wire import Connection
from support.daemon import DaemonProc, child_env
from support.mooncake_loopback import MooncakeCluster


def cluster_config(cluster: MooncakeCluster, **kw: object) -> ClusterConfig:
    """A client of `cluster` with test-sized buffers and short deadlines."""
    base: dict[str, object] = dict(
        enabled=True,
        master=cluster.master,
        metadata=cluster.metadata,
        staging_bytes=4 << 20,
        transfer_buffer_bytes=4 << 20,
        lookup_timeout_s=2.0,  # a presence check the tests rely on must not miss on a loaded 2-core machine
        load_timeout_s=2.0,
        put_timeout_s=5.0,
        retry_s=0.5,
    )
    if cluster.etcd_endpoint:
        base["etcd"] = cluster.etcd_endpoint
    return ClusterConfig(**{**base, **kw})


# Short deadlines and small buffers for the fault tests, which kill or stop parts of the cluster and wait for
# the node to notice: passed by those tests by name, so a node that is not given them runs on the defaults.
FAULT_TUNING: dict[str, object] = dict(
    staging_bytes="4MiB",
    transfer_buffer_bytes="4MiB",
    lookup_timeout_s=0.5,
    load_timeout_s=2.0,
    put_timeout_s=5.0,
    retry_s=0.5,
)


def cluster_toml(cluster: MooncakeCluster, **kw: object) -> str:
    """A `[cluster]` table naming `cluster`'s endpoints (master or etcd, metadata, admin) and `kw`; every other
    key is its default, as a user's node would have it (fault tests pass FAULT_TUNING)."""
    values: dict[str, object] = dict(
        enabled=True, master=cluster.master, metadata=cluster.metadata, admin=cluster.admin
    )
    if cluster.etcd_endpoint:
        values["etcd"] = cluster.etcd_endpoint
    values.update(kw)

    def toml(v: object) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)

    return "[cluster]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in values.items())


def start_node(tmp: Path, name: str, cluster: MooncakeCluster, **kw: object) -> DaemonProc:
    """A daemon in tmp/name (its own store, socket and log) on `cluster`."""
    home = tmp / name
    home.mkdir(parents=True, exist_ok=True)
    return DaemonProc(home, extra_toml=cluster_toml(cluster, **kw))


def cluster_stats(node: DaemonProc) -> dict[str, Any]:
    """The node's cluster-tier document from its stats (`kvtier status --json`'s `cluster`)."""
    with Connection(node.socket, timeout_s=10.0, name="cluster test") as conn:
        return conn.stats().cluster


def wait_for(what: str, cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)  # polling a real condition


def wait_written_through(node: DaemonProc, at_least: int, timeout: float = 30.0) -> dict[str, Any]:
    """Poll until the node has written at least `at_least` objects to the cluster and its backlog is empty."""
    box: dict[str, Any] = {}

    def done() -> bool:
        box.update(cluster_stats(node))
        return box["written_through"] >= at_least and box["backlog_bytes"] == 0

    try:
        wait_for(f"{at_least} objects written through", done, timeout)
    except AssertionError as exc:  # what the node said last, not what it said before the first poll
        raise AssertionError(f"{exc} (last: {box})") from None
    return box


def kvtier_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, env=child_env(), timeout=120
    )


def audit_cli(node: DaemonProc, config: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """`kvtier audit --cluster --json` of the node's store and the cluster `config` names: exit code, cluster part."""
    run = kvtier_cli(
        "audit", "--store", str(node.tmp / "store"), "--cluster", "--config", str(config), "--json", *extra
    )
    assert run.stdout, run.stderr
    return run.returncode, json.loads(run.stdout)["cluster"]
