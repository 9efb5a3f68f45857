"""vLLM with a kvtier daemon owning the store: engines store and hit through the daemon's raw tier ops.

On a node running `kvtier serve`, the daemon holds the store's writer lock; an engine's tier configured
with `daemon_socket` stores through it (an in-process store there could only read) and loads verified
bytes through a staging region shared with the daemon.
"""

from __future__ import annotations

from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

from support.daemon import DaemonProc  # noqa: E402
from support.vllm_harness import (  # noqa: E402
    KVTIER_TIER,
    assert_same_output,
    audit_namespaces,
    kvtier_audit,
    kvtier_daemon_tiers,
    new_checkpoint,
    run_engine,
    shared_prefix_prompts,
)

FULL = "vllm.g0.full"
PREFIX_CHUNKS = 4


def test_engines_store_and_hit_through_the_daemon(tmp_path: Path) -> None:
    model = new_checkpoint(tmp_path / "model", seed=1)
    prompts = shared_prefix_prompts(seed=0)
    store = tmp_path / "store"
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProc(tmp_path / "daemon", store_root=store)
    try:
        tiers = kvtier_daemon_tiers(daemon.socket)
        first = run_engine(tmp_path, "store", model, prompts, tiers)
        assert first.counter("chunk_hits", KVTIER_TIER) == 0
        assert (
            first.kvtier("store_chunks", outcome="stored") == PREFIX_CHUNKS
        )  # written by the daemon, the store's writer
        assert first.kvtier("store_chunks", outcome="read_only") == 0
        assert "through the daemon on" in (tmp_path / "store.log").read_text(errors="replace")

        second = run_engine(tmp_path, "hit", model, prompts, tiers)
        assert second.counter("chunk_hits", KVTIER_TIER) == PREFIX_CHUNKS
        assert second.kvtier("load_chunks", outcome="ok") == PREFIX_CHUNKS
        assert second.kvtier("store_chunks", outcome="stored") == 0
        assert_same_output(first, second)  # tokens and logprobs, bit for bit

        # `kvtier audit` (its own process, every record re-read) sees the engine's records under its namespace,
        # while the daemon keeps serving; the daemon's own profile namespace holds none of them.
        code, report = kvtier_audit(store)
        assert code == 0 and report["corrupt"] == report["quarantined"] == 0
        listed = audit_namespaces(store)
        (namespace,) = [ns for ns, n in listed.items() if n["records"]]
        assert listed[namespace]["version_key"]["model_id"] == model
        assert {(r["group"], r["form"], r["state"]) for r in listed[namespace]["records"]} == {
            (FULL, "compressed", "live")
        }
        audited = {n["namespace"]: n for n in report["namespaces"]}
        assert audited[namespace]["forms"]["compressed"]["entries"] == PREFIX_CHUNKS
        assert daemon.proc.poll() is None and "Traceback" not in daemon.read_log()
    finally:
        assert daemon.terminate() == 0
