"""Identity from what the engine runs: the same checkpoint at the same path, launched with other settings.

Engine A stores a shared prefix. An engine launched from the same folder with a setting that changes KV
bytes (RoPE base, YaRN scaling, dtype, KV cache dtype) must get no kvtier hit and produce exactly what it produces with
no offloading at all; one launched with a setting that changes no KV byte (max_num_seqs) hits as before.
RoPE is applied to K before it is cached, so serving A's rows to a RoPE-overridden engine gives wrong
tokens from the first generated one: kvtier's namespace comes from vLLM's resolved config, not config.json.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.vllm_harness import require_vllm

require_vllm()

from support.daemon import DaemonProc  # noqa: E402
from support.vllm_harness import (  # noqa: E402
    ENGINE_TIMEOUT_S,
    KVTIER_TIER,
    EngineRun,
    assert_same_output,
    kvtier_audit,
    kvtier_daemon_tiers,
    kvtier_tiers,
    new_checkpoint,
    run_engine,
    shared_prefix_prompts,
)

PREFIX_CHUNKS = 4
ROPE_THETA = 10000.0  # the tiny checkpoint's (transformers' default for Llama)
# `--hf-overrides`: transformers 5 configs keep RoPE in `rope_parameters` (a top-level rope_theta is ignored there).
ROPE_4X = {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 4 * ROPE_THETA}}}
YARN = {
    "hf_overrides": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": ROPE_THETA,
            "factor": 2.0,
            "original_max_position_embeddings": 512,
        }
    }
}


def assert_misses_and_matches_its_own_baseline(
    tmp_path: Path, name: str, model: str, prompts: list, tiers: list[dict], stored: EngineRun, args: dict
) -> EngineRun:
    """The overridden engine: no kvtier hit, output equal to its own run without offloading; that output differs
    from the storing engine's, so a hit on the stored rows would have changed it."""
    got = run_engine(tmp_path, name, model, prompts, tiers, engine_args=args)
    baseline = run_engine(tmp_path, f"{name}-baseline", model, prompts, [], engine_args=args)
    assert got.counter("chunk_queries", KVTIER_TIER) > 0  # it asked kvtier, and kvtier said no
    assert got.counter("chunk_hits", KVTIER_TIER) == 0 and got.kvtier("lookups", result="hit") == 0
    assert_same_output(baseline, got)
    assert [r["logprobs"] for r in baseline.results] != [r["logprobs"] for r in stored.results]
    return got


@pytest.mark.timeout(11 * ENGINE_TIMEOUT_S)  # eleven engine processes, each bounded on its own
def test_launch_time_overrides_that_change_kv_bytes_never_hit_another_configurations_records(tmp_path: Path) -> None:
    model = new_checkpoint(tmp_path / "model", seed=1)
    prompts = shared_prefix_prompts(seed=0)
    store = tmp_path / "store"
    tiers = kvtier_tiers(store)
    stored = run_engine(tmp_path, "store", model, prompts, tiers)
    assert stored.kvtier("store_chunks", outcome="stored") == PREFIX_CHUNKS

    rope = assert_misses_and_matches_its_own_baseline(tmp_path, "rope", model, prompts, tiers, stored, ROPE_4X)
    assert [r["tokens"] for r in rope.results] != [r["tokens"] for r in stored.results]
    assert_misses_and_matches_its_own_baseline(tmp_path, "yarn", model, prompts, tiers, stored, YARN)
    assert_misses_and_matches_its_own_baseline(tmp_path, "fp32", model, prompts, tiers, stored, {"dtype": "float32"})
    fp8 = {"kv_cache_dtype": "fp8_e5m2"}  # the CPU backend's quantised KV cache
    assert_misses_and_matches_its_own_baseline(tmp_path, "fp8-kv", model, prompts, tiers, stored, fp8)

    # A setting that changes no KV byte: the same namespace, every prefix chunk a hit, the same output.
    batch = run_engine(tmp_path, "max-num-seqs", model, prompts, tiers, engine_args={"max_num_seqs": 7})
    assert batch.counter("chunk_hits", KVTIER_TIER) == PREFIX_CHUNKS
    assert_same_output(stored, batch)

    # The audit shows each namespace's resolved identity: the override is there, as vLLM resolved it.
    code, report = kvtier_audit(store)
    assert code == 0
    thetas = sorted(
        n["identity"]["model_config"]["hf_config"]["rope_parameters"]["rope_theta"] for n in report["namespaces"]
    )
    assert thetas == [ROPE_THETA] * 4 + [4 * ROPE_THETA]  # stored (and max_num_seqs), yarn, fp32, fp8 KV; rope
    for n in report["namespaces"]:
        assert n["version_key"]["engine_config"].startswith("blake2b16:")
        assert "hf_token" not in n["identity"]["model_config"] and "scheduler_config" not in n["identity"]


@pytest.mark.timeout(4 * ENGINE_TIMEOUT_S)
@pytest.mark.parametrize("override", [ROPE_4X], ids=["rope_theta"])
def test_through_the_daemon_a_rope_override_gets_no_hit(tmp_path: Path, override: dict) -> None:
    model = new_checkpoint(tmp_path / "model", seed=1)
    prompts = shared_prefix_prompts(seed=0)
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProc(tmp_path / "daemon", store_root=tmp_path / "store")
    try:
        tiers = kvtier_daemon_tiers(daemon.socket)
        stored = run_engine(tmp_path, "store", model, prompts, tiers)
        assert stored.kvtier("store_chunks", outcome="stored") == PREFIX_CHUNKS
        assert_misses_and_matches_its_own_baseline(tmp_path, "rope", model, prompts, tiers, stored, override)
        assert run_engine(tmp_path, "hit", model, prompts, tiers).counter("chunk_hits", KVTIER_TIER) == PREFIX_CHUNKS
    finally:
        assert daemon.terminate() == 0
