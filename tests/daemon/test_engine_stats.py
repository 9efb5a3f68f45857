"""Per-namespace visibility (issue 39): `kvtier status` (text and --json) and /metrics show what each engine
namespace's tier asked, hit, loaded and stored through a real daemon, labelled by namespace and engine."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

from kvtier.client import Client, TierClient
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.daemon.tier_stats import OTHER, TierStats
from support.daemon import DaemonProc, child_env
from support.promlint import problems, promtool
from support.verifier_helpers import wait_for

VLLM = VersionKey("org/model-a", "xxh3_128:0a", "vllm 0.32.0;cpu;attn=FLASH", "none", "none", "bf16;chunk=4096")
SGLANG = VersionKey("org/model-b", "xxh3_128:0b", "sglang-0.5.23", "none", "none", "kv=bf16;page=64t")
GROUPS = [("g0.full", CacheForm.COMPRESSED)]
DIGEST = bytes(16)
OBJ = 4096


def _keys(vk: VersionKey, n: int, first: int = 0) -> list[ObjectKey]:
    return [ObjectKey(vk.namespace, i.to_bytes(16, "big"), *GROUPS[0]) for i in range(first, first + n)]


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], env=child_env(), capture_output=True, text=True, timeout=120
    )


def test_status_and_metrics_show_each_engine_namespace(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path, extra_toml=f'[events]\nendpoint = "ipc://{tmp_path}/ev.sock"\n')
    try:
        payload = torch.arange(OBJ, dtype=torch.int32).to(torch.uint8)
        with TierClient(d.socket, VLLM, GROUPS, 4 * OBJ) as v, TierClient(d.socket, SGLANG, GROUPS, 4 * OBJ) as s:
            v.store_many([(k, payload, DIGEST) for k in _keys(VLLM, 3)])  # 3 stored
            asked = _keys(VLLM, 5)  # 3 of them there: 3 hits, 2 misses
            assert [r is Reason.OK for r in v.has(asked, [DIGEST] * 5)] == [True] * 3 + [False] * 2
            outs = [torch.empty(OBJ, dtype=torch.uint8) for _ in range(4)]
            reasons = v.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(_keys(VLLM, 4), outs)])
            assert reasons.count(Reason.OK) == 3  # 3 loaded, 1 failed (missing)
            s.store_many([(k, payload, DIGEST) for k in _keys(SGLANG, 2)])
            assert s.has(_keys(SGLANG, 1, first=7), [DIGEST]) == [Reason.MISSING]

            with Client(d.socket) as c:  # the events thread counts a batch once it has sent it: asynchronously
                wait_for(lambda: c.stats().events.stored == 5, 20.0, what="5 stored events sent")
            out = _kvtier("status", "--socket", str(d.socket), "--json")
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            rows = {e["namespace"]: e for e in doc["engines"]}
            a, b = rows[VLLM.namespace.hex()], rows[SGLANG.namespace.hex()]
            assert (a["engine"], a["model"], a["connections"]) == ("vllm", "org/model-a", 1)
            assert (a["lookups"], a["hits"], a["loads"], a["load_failures"]) == (5, 3, 3, 1)
            assert (a["bytes_loaded"], a["stores"], a["bytes_stored"]) == (3 * OBJ, 3, 3 * OBJ)
            assert (b["engine"], b["lookups"], b["hits"], b["stores"], b["loads"]) == ("sglang", 1, 0, 2, 0)
            assert doc["events"]["stored"] == 5 and doc["events"]["endpoint"].startswith("ipc://")

            text = _kvtier("status", "--socket", str(d.socket)).stdout
            table = text.split("engine namespace", 1)[1].splitlines()  # the engine table follows its header
            line = next(ln for ln in table if ln.startswith(VLLM.namespace.hex()))
            assert line.split()[1:5] == ["vllm", "org/model-a", "1", "5"] and "60.0%" in line
            assert "events     ipc://" in text and "5 stored, 0 removed" in text

        with Client(d.socket) as c:
            address = c.stats().daemon.metrics
            # a connection's worker counts it out once it reads the client's close: asynchronously to this test
            wait_for(lambda: all(e.connections == 0 for e in c.stats().engines), 20.0, what="connections counted out")
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    finally:
        d.close()
    ns = VLLM.namespace.hex()
    for sample in (
        f'kvtier_engine_lookup_objects_total{{engine="vllm",namespace="{ns}",result="hit"}} 3.0',
        f'kvtier_engine_lookup_objects_total{{engine="vllm",namespace="{ns}",result="miss"}} 2.0',
        f'kvtier_engine_load_objects_total{{engine="vllm",namespace="{ns}",outcome="failed"}} 1.0',
        f'kvtier_engine_loaded_bytes_total{{engine="vllm",namespace="{ns}"}} {3.0 * OBJ}',
        f'kvtier_engine_stored_objects_total{{engine="sglang",namespace="{SGLANG.namespace.hex()}"}} 2.0',
        'kvtier_kv_event_objects_total{change="stored"} 5.0',
    ):
        assert sample in body, sample
    assert f'kvtier_engine_connections{{engine="vllm",namespace="{ns}"}} 0.0' in body  # closed since
    assert problems(body) == []
    assert not promtool(body)  # None where promtool is not installed


def test_label_values_are_bounded() -> None:
    """Past MAX_NAMESPACES namespaces, the counts go to one "other" row: the metrics' labels stay bounded."""
    stats = TierStats(max_namespaces=2)
    keys = [VersionKey(f"m{i}", "w", "vllm 0.32.0", "none", "none", "bf16") for i in range(5)]
    for vk in keys:
        stats.opened(vk.namespace, vk)
        stats.looked_up(vk.namespace, [Reason.OK, Reason.MISSING])
    stats.closed(keys[4].namespace)
    rows = {r.namespace: r for r in stats.snapshot()}
    assert list(rows) == [keys[0].namespace.hex(), keys[1].namespace.hex(), OTHER]
    assert (rows[OTHER].lookups, rows[OTHER].hits, rows[OTHER].connections) == (6, 3, 2)
    assert rows[keys[0].namespace.hex()].engine == "vllm" and rows[OTHER].engine == OTHER
