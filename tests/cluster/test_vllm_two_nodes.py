"""Two cluster nodes under real vLLM engines (issue 40): node B restores node A's prefix through its daemon.

Each node is a `kvtier serve` whose `[cluster]` table names the cluster's endpoints only (cluster_toml): every
other cluster key is its default, `lookup_timeout_s` included. The daemons and
the Mooncake cluster run from this suite's Python (it has Mooncake); the engines run from the vLLM venv
(tests/vllm/run.sh builds it; it has no Mooncake and needs none: an engine talks to its node's daemon over the
unix socket only). Each engine is a process of its own, so engine B starts with nothing in RAM and everything
it reuses comes from node B's daemon, which had to get it from the cluster (node B's store starts empty).

The model is tiny Gemma2 (layer 0 sliding window 64, layer 1 full): its SWA group is a state form, so the hit
also shows that the default write-through sends the state objects a hit on another node needs.

The vLLM Python: $KVTIER_VLLM_PYTHON, else bin/python of $KVTIER_VLLM_VENV (default bench/.venv-vllm).
Without it the test skips with one line (tests/cluster/run.sh prepares it and, with CI=true, fails instead).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from kvtier.wire import Connection
from kvtier.wire.stats import EngineNamespaceStats
from support.cluster_nodes import cluster_stats, cluster_toml, wait_written_through
from support.daemon import ROOT, DaemonProc
from support.mooncake_loopback import MooncakeCluster

BLOCK_SIZE = 32  # support.vllm_engine_run.BLOCK_SIZE (not imported: that module's siblings need transformers)
VOCAB = 512  # support.vllm_tiny_model.VOCAB
WINDOW_CHUNKS = 2  # Gemma2's window of 64 tokens in 32-token chunks
PREFIX_CHUNKS = 4
REQUEST_KEYS = 2 * PREFIX_CHUNKS  # the prompt's whole chunks, one key per chunk in each of the two groups
ENGINE_TIMEOUT_S = 300
KVTIER_TIER = "KvtierSecondaryTier"


def vllm_python() -> str:
    """The vLLM venv's python, or skip (fail where run.sh prepared it) with one line saying how to get it."""
    venv = Path(os.environ.get("KVTIER_VLLM_VENV", ROOT / "bench" / ".venv-vllm"))
    py = os.environ.get("KVTIER_VLLM_PYTHON") or str(venv / "bin" / "python")
    try:
        probe = subprocess.run(  # without tests/ on the path, where the folder tests/vllm would import as `vllm`
            [py, "-c", "import vllm.v1.kv_offload.tiering.base, transformers"],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        missing = probe.stderr.strip()[-300:] if probe.returncode else None
    except FileNotFoundError as exc:  # no venv there at all: a checkout that never built it
        missing = str(exc)
    if missing is not None:
        why = f"no vLLM at {py} (build it: bash tests/vllm/run.sh --prepare): {missing}"
        if os.environ.get("KVTIER_CLUSTER_VLLM_REQUIRED") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return py


def in_vllm_venv(py: str, code: str, *args: str, log: Path, timeout: float = ENGINE_TIMEOUT_S) -> None:
    """Run `code` (argv: args) in a fresh process of the vLLM venv, this checkout's kvtier and tests/support first
    on its path; its output goes to `log`, whose tail a failure shows."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    with open(log, "wb") as out:
        proc = subprocess.run(
            [py, "-c", code, *args], stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=log.parent
        )
    assert proc.returncode == 0, f"{log.name}: exit {proc.returncode}; tail:\n{log.read_text(errors='replace')[-4000:]}"


def run_engine(
    py: str, work: Path, name: str, model: Path, prompts: list[list[int]], socket: Path | None, shutdown: bool = False
) -> dict:
    """One engine process generating greedily; its results and tier counters (support.vllm_engine_run's JSON).

    The counters are read when the last request returns, before stores still in flight finish; `shutdown` shuts
    the engine down after that, so every chunk it offloaded has reached its daemon when the process exits."""
    tiers = [] if socket is None else [{"type": KVTIER_TIER, "module_path": "kvtier.integrations.vllm"}]
    if socket is not None:
        tiers[0]["daemon_socket"] = str(socket)
    spec, out = work / f"{name}.spec.json", work / f"{name}.out.json"
    doc = {"model": str(model), "prompts": prompts, "max_tokens": 8, "secondary_tiers": tiers, "shutdown": shutdown}
    spec.write_text(json.dumps(doc))
    code = "import sys; from support.vllm_engine_run import main; main(sys.argv[1], sys.argv[2])"
    in_vllm_venv(py, code, str(spec), str(out), log=work / f"{name}.log")
    return json.loads(out.read_text())


def vllm_row(node: DaemonProc) -> EngineNamespaceStats:
    """The daemon's counters of the vLLM engine's tier ops, its one namespace (`kvtier status`'s engines)."""
    with Connection(node.socket, timeout_s=10.0, name="cluster test") as conn:
        (row,) = [row for row in conn.stats().engines if row.engine == "vllm"]
    return row


def tier_counter(run: dict, name: str, tier: str) -> float:
    """Sum of vLLM's `tiering_<name>` over labels naming `tier` (vLLM labels tiers "<index>:<type>")."""
    return sum(v for k, v in run["metrics"].items() if k.startswith(f"tiering_{name}{{") and k.endswith(f":{tier}}}"))


def kvtier_counter(run: dict, name: str, **labels: str) -> float:
    """Sum of the kvtier tier's `kvtier_<name>` over label sets that include all of `labels`."""
    want = {f"{k}={v}" for k, v in labels.items()}
    total = 0.0
    for key, value in run["metrics"].items():
        metric, _, rest = key.partition("{")
        if metric == f"kvtier_{name}" and want <= set(filter(None, rest.rstrip("}").split(","))):
            total += value
    return total


@pytest.mark.timeout(1200)  # three engine processes (each imports vLLM) and two daemons on a loaded 2-core machine
def test_node_b_restores_node_a_prefix_through_its_daemon(own_cluster: MooncakeCluster, tmp_path: Path) -> None:
    py = vllm_python()
    model = tmp_path / "model"
    write = "import sys, pathlib; from support.vllm_tiny_model import write_checkpoint as w; "
    write += "w(pathlib.Path(sys.argv[1]), 3, 'gemma2')"
    in_vllm_venv(py, write, str(model), log=tmp_path / "checkpoint.log", timeout=120)
    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(PREFIX_CHUNKS * BLOCK_SIZE + 20)]

    reference = run_engine(py, tmp_path, "no-offload", model, [prompt], None)

    nodes = {name: tmp_path / name for name in ("node-a", "node-b")}
    for home in nodes.values():
        home.mkdir()
    node_a = DaemonProc(nodes["node-a"], extra_toml=cluster_toml(own_cluster))
    node_b = None
    try:
        stored = run_engine(py, tmp_path, "engine-a", model, [prompt], node_a.socket, shutdown=True)
        # vLLM offers every chunk of the full group and the trailing window of the sliding one. Counted by the
        # daemon: the engine's own counter, read when its only request returns, counts only the stores that
        # finished during its 8 decode steps (a race that failed CI).
        assert (row := vllm_row(node_a)).stores == PREFIX_CHUNKS + WINDOW_CHUNKS, row
        assert stored["results"] == reference["results"]
        wait_written_through(node_a, PREFIX_CHUNKS + WINDOW_CHUNKS, timeout=60)
        # Node A is stopped: node B can get the prefix only from the cluster.
        assert node_a.terminate() == 0

        node_b = DaemonProc(nodes["node-b"], extra_toml=cluster_toml(own_cluster))
        restored = run_engine(py, tmp_path, "engine-b", model, [prompt], node_b.socket)
        hits = tier_counter(restored, "chunk_hits", KVTIER_TIER)
        assert hits == PREFIX_CHUNKS + WINDOW_CHUNKS, restored["metrics"]
        assert kvtier_counter(restored, "lookups", form="swa", result="hit") == WINDOW_CHUNKS
        # Node B's own store had none of it: the tier asked its daemon (which asked the cluster), not its key set.
        assert kvtier_counter(restored, "lookups", result="asking_daemon") > 0
        assert kvtier_counter(restored, "load_chunks", outcome="ok") == PREFIX_CHUNKS + WINDOW_CHUNKS
        stats = cluster_stats(node_b)
        assert stats["local_hits"] == 0 and stats["cluster_hits"] == PREFIX_CHUNKS + WINDOW_CHUNKS, stats
        # One remote lookup for B's request, not a loop: vLLM asks the tier again every engine step while the
        # request waits (each a RETRY, counted as asking_daemon), but the tier asked the daemon once, for all of
        # the request's keys (every chunk of both groups), and the daemon asked the cluster once.
        assert (row := vllm_row(node_b)).lookups == REQUEST_KEYS, row
        assert stats["cluster"]["lookups"] == REQUEST_KEYS, stats
        assert sum(stats["cluster"]["lookup_latency"]["counts"]) == 1, stats
        # Generated tokens and their logprobs, bit for bit, as the run that never offloaded.
        assert restored["results"] == reference["results"]
        assert node_b.terminate() == 0
    finally:
        node_a.close()
        if node_b is not None:
            node_b.close()
