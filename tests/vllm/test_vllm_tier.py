"""kvtier as a real vLLM engine's disk tier: engines in fresh processes store into and hit a kvtier store.

One flow over one store, as an operator would see it: engine 1 computes and stores; engine 2 (a new
process) hits kvtier and reproduces engine 1 exactly; then (a) a flipped bit on disk is recomputed, never
served, (b) a new checkpoint under the same path is a new namespace (no hit across weights), and (c)
`kvtier audit` sees the records under the namespace of the engine that wrote them.
"""

from __future__ import annotations

from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

from support.vllm_harness import (  # noqa: E402
    KVTIER_TIER,
    assert_same_output,
    audit_namespaces,
    flip_payload_byte,
    kvtier_audit,
    kvtier_tiers,
    new_checkpoint,
    run_engine,
    shared_prefix_prompts,
)

FULL = "vllm.g0.full"  # the Llama's one KV group: full attention, filed as a history form
PREFIX_CHUNKS = 4


def test_engine_hits_kvtier_and_never_serves_corrupt_or_foreign_records(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model = new_checkpoint(model_dir, seed=1)
    prompts = shared_prefix_prompts(seed=0)
    store = tmp_path / "store"
    tiers = kvtier_tiers(store)

    first = run_engine(tmp_path, "store", model, prompts, tiers)
    assert first.counter("chunk_hits", KVTIER_TIER) == 0
    assert first.kvtier("store_chunks", outcome="stored") == PREFIX_CHUNKS  # the shared prefix, once

    second = run_engine(tmp_path, "hit", model, prompts, tiers)
    assert second.counter("chunk_hits", KVTIER_TIER) == PREFIX_CHUNKS
    assert second.kvtier("load_chunks", outcome="ok") == PREFIX_CHUNKS
    assert second.counter("read_bytes", KVTIER_TIER) > 0
    assert_same_output(first, second)  # tokens and logprobs, bit for bit

    # (a) One flipped bit in one record: the load fails verification, vLLM recomputes, the record is quarantined.
    flip_payload_byte(store, FULL, nth=1)
    corrupt = run_engine(tmp_path, "corrupt", model, prompts, tiers)
    assert corrupt.kvtier("load_chunks", outcome="corrupt") == 1
    assert corrupt.counter("promotion_job_failures", KVTIER_TIER) >= 1
    assert corrupt.kvtier("lookups", result="failed") >= 1  # vLLM asked again: a miss, not an endless hit
    assert_same_output(first, corrupt)
    # The recompute stored a fresh copy of the quarantined chunk (records are immutable; the key repoints).
    assert corrupt.kvtier("store_chunks", outcome="stored") == 1
    (namespace,) = audit_namespaces(store)
    assert [r["state"] for r in audit_namespaces(store)[namespace]["records"]] == ["live"] * PREFIX_CHUNKS

    # (b) A new checkpoint under the same path: a new namespace, so every lookup misses.
    new_checkpoint(model_dir, seed=2)
    reweighted = run_engine(tmp_path, "new-weights", model, prompts, tiers)
    assert reweighted.counter("chunk_queries", KVTIER_TIER) > 0
    assert reweighted.counter("chunk_hits", KVTIER_TIER) == 0
    assert reweighted.kvtier("lookups", result="hit") == 0
    assert [r["tokens"] for r in reweighted.results] != [r["tokens"] for r in first.results]

    # (c) `kvtier audit` (its own process, every record re-read and checksummed) sees each engine's records
    # under that engine's namespace, all intact.
    code, report = kvtier_audit(store)
    assert code == 0 and report["corrupt"] == report["quarantined"] == 0
    audited = {n["namespace"]: n for n in report["namespaces"]}
    assert set(audited) == set(audit_namespaces(store)) and namespace in audited and len(audited) == 2
    new_ns = next(ns for ns in audited if ns != namespace)
    old_key, new_key = audited[namespace]["version_key"], audited[new_ns]["version_key"]
    assert old_key["model_id"] == new_key["model_id"] == model
    assert old_key["weights_digest"] != new_key["weights_digest"]
    assert old_key["kernel_abi"] == new_key["kernel_abi"] == "vllm 0.32.0;cpu;attn=full:CPUAttentionBackend"
    for ns in (namespace, new_ns):
        forms = audited[ns]["forms"]
        assert forms["compressed"]["entries"] == PREFIX_CHUNKS and forms["compressed"]["corrupt"] == 0
        assert sum(f["entries"] for f in forms.values()) == PREFIX_CHUNKS
        assert {(r["group"], r["form"]) for r in audit_namespaces(store)[ns]["records"]} == {(FULL, "compressed")}
