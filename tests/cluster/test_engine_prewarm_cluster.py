"""`kvtier prewarm` of an engine namespace loads what only the cluster holds onto the node's disk.

Node 1's engine stored a prompt's chunks (written through to a real loopback Mooncake cluster). On node 2 the
engine has just started: its tier opened the namespace there, and node 2's disk holds none of its records.
`kvtier prewarm` through node 2 loads every chunk from the cluster, promotes it to node 2's disk and pins it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.client import TierClient
from kvtier.store import DiskStore
from support.cluster_nodes import cluster_stats, kvtier_cli, start_node, wait_for, wait_written_through
from support.engine_records import (
    CHUNK,
    CHUNKS,
    GROUPS,
    engine_model,
    engine_tokens,
    engine_vkey,
    store_engine_records,
)
from support.mooncake_loopback import MooncakeCluster


def test_prewarm_brings_an_engine_prompt_from_the_cluster(own_cluster: MooncakeCluster, tmp_path: Path) -> None:
    model = engine_model(tmp_path / "model", 1)
    vkey, tokens = engine_vkey(model), engine_tokens(0)
    node1 = start_node(tmp_path, "node1", own_cluster)
    node2 = start_node(tmp_path, "node2", own_cluster)
    try:
        keys = store_engine_records(node1.socket, vkey, tokens, skip={})
        wait_written_through(node1, len(keys))
        with TierClient(node2.socket, vkey, GROUPS, 0, identity={"model_config": {}}):
            pass  # the engine's tier on node 2 opened its namespace there
        manifest = tmp_path / "m.jsonl"
        manifest.write_text(json.dumps({"engine": "vllm", "model_dir": str(model), "tokens": tokens}) + "\n")
        run = kvtier_cli("prewarm", str(manifest), "--socket", str(node2.socket), "--json")
        assert run.returncode == 0, run.stderr
        (rep,) = json.loads(run.stdout)["prefixes"]
        assert rep["hit_tokens"] == CHUNKS * CHUNK
        assert rep["loaded_objects"] == len(keys) and rep["pinned"] == len(keys), rep
        assert cluster_stats(node2)["cluster_hits"] == len(keys)
        wait_for("promotions to node 2's disk", lambda: cluster_stats(node2)["promoted"] >= len(keys), 20)
        with DiskStore(str(tmp_path / "node2" / "store"), readonly=True) as s:
            assert all(i is not None and i.entry is not None for i in s.records(keys))  # on node 2's disk now

        run = kvtier_cli("prewarm", str(manifest), "--socket", str(node2.socket), "--json")
        (again,) = json.loads(run.stdout)["prefixes"]
        assert again["loaded_objects"] == 0 and again["hit_tokens"] == CHUNKS * CHUNK  # local: nothing to load
        assert node2.terminate() == 0 and node1.terminate() == 0
    finally:
        node1.close()
        node2.close()
