"""Run one vLLM engine (in this process) over a prompt set and write tokens, logprobs and tier metrics as JSON.

Usage: python vllm_engine_run.py SPEC.json OUT.json
(SPEC: model, prompts, max_tokens, secondary_tiers, engine_args: launch-time settings over the tests' own, and
shutdown: shut the engine down before exiting, so its tiers finish their queued stores)
The tests call `main` in a new process per engine (vllm_harness.run_engine), so a second engine sees only
what the first left in the secondary tier.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BLOCK_SIZE = 32  # tokens per KV block and per offloaded chunk (CPU attention wants multiples of 32)


def engine_kwargs(model: str, secondary_tiers: list[dict]) -> dict:
    """The engine as the tests run it: tiny, eager, CPU, prefix hashes stable across processes."""
    return dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256",
        disable_log_stats=False,
        seed=0,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "spec_name": "SyncCpuTieringSpec",
                "spec_module_path": "support.vllm_cpu_shim",
                "cpu_bytes_to_use": 8 << 20,
                "secondary_tiers": secondary_tiers,
            },
        },
    )


def tier_counters(metrics) -> dict[str, float]:
    """vllm:kv_offload_tiering_* counters summed per (name, tier); vllm:kvtier_* per (name, their own labels)."""
    out: dict[str, float] = {}
    for m in metrics:
        if not hasattr(m, "value"):
            continue
        short = m.name.split(":")[-1]
        if short.startswith("kv_offload_tiering"):
            key = f"{short.removeprefix('kv_offload_')}{{{m.labels.get('tier', '')}}}"
        elif short.startswith("kvtier_"):
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k in ("form", "result", "outcome"))
            key = f"{short}{{{labels}}}"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(m.value)
    return out


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(**{**engine_kwargs(spec["model"], spec["secondary_tiers"]), **spec.get("engine_args", {})})
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0, ignore_eos=True)
    results = []
    # One request at a time, in order: later prompts may reuse what earlier ones stored.
    for ids in spec["prompts"]:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
        logprobs = [step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs)]
        results.append({"tokens": list(out.token_ids), "logprobs": logprobs})
    metrics = tier_counters(llm.get_metrics())
    if spec.get("shutdown"):
        # the engine's own shutdown (scheduler -> connector -> tiers): the tiers finish their queued stores, so
        # everything the engine offloaded is in the secondary tier when this process exits
        llm.llm_engine.engine_core.shutdown()
    Path(out_path).write_text(json.dumps({"results": results, "metrics": metrics}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
