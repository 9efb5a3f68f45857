"""The engine identity behind a vLLM tier's namespace: checkpoint bytes, the engine's resolved configuration,
KV dtype and chunk layout, vLLM and kernel.

Two engines share records only when every field here is equal. The configuration is what vLLM resolved
(`VllmConfig`: the Hugging Face config after `--hf-overrides`, dtype, KV cache dtype, quantization, RoPE as
resolved, ...), rendered whole except the fields in `VLLM_EXCLUDED`, each with the reason it cannot change a
cached byte; a field a later vLLM adds therefore changes the namespace. A new checkpoint written under the
same path changes `weights_digest`, so it is a new namespace (never a hit across weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.core.versions import VersionKey
from kvtier.integrations.checkpoint import weights_digest
from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.resolved_config import canonical, digest
from kvtier.integrations.vllm.groups import EngineGroup, GroupPlan, plan_groups

log = logging.getLogger("vllm.kvtier")

# The compressor's and indexer's settings are part of the resolved model config, so `engine_config` covers them.
IN_ENGINE_CONFIG = "in engine_config"

_NOT_KV = "decides which requests and tokens run when, or where bytes go, never the KV of a token prefix"
_SAMPLING = "acts after the last layer (sampling, logprobs, outputs): a prompt's KV is computed before it"
_HF_METADATA = {
    "_name_or_path": "the folder the config was read from: the key's model_id names it, the weights are digested",
    "transformers_version": "the library version that wrote config.json",
    "id2label": "labels of a classification head, after the last layer",
    "label2id": "labels of a classification head, after the last layer",
    "bos_token_id": "a token id for prompt building and stopping: the cache is keyed by the token ids themselves",
    "eos_token_id": "a token id for prompt building and stopping: the cache is keyed by the token ids themselves",
    "pad_token_id": "a token id for prompt building and stopping: the cache is keyed by the token ids themselves",
    "output_attentions": "a Hugging Face forward() flag vLLM does not read",
    "output_hidden_states": "a Hugging Face forward() flag vLLM does not read",
    "return_dict": "a Hugging Face forward() flag vLLM does not read",
    "use_cache": "a Hugging Face forward() flag vLLM does not read",
}
# Dotted paths of `VllmConfig` left out of the namespace, each with why it cannot change a cached KV byte.
VLLM_EXCLUDED: dict[str, str] = {
    "scheduler_config": _NOT_KV,
    "parallel_config": "the split over workers: the chunk layout carries the sizes that shape a row; the rest are "
    "ports, ranks and process counts",
    "compilation_config": "compiled or captured execution of the same operators (and the live layer objects)",
    "model_config.enforce_eager": "runs the same operators without graph capture",
    "kv_transfer_config": "the connector's and tiers' own settings (store paths, sizes, a per-launch engine id)",
    "kv_events_config": "publishes cache events",
    "ec_transfer_config": "moves encoder outputs between engines",
    "ec_manager_config": "sizes the encoder output cache",
    "observability_config": "metrics and tracing",
    "logging_config": "logging",
    "profiler_config": "profiling",
    "structured_outputs_config": _SAMPLING,
    "reasoning_config": _SAMPLING,
    "instance_id": "a random id drawn at each launch",
    "shutdown_timeout": "shutdown",
    "model_config.tokenizer": "turns text into token ids before the cache sees them",
    "model_config.tokenizer_mode": "turns text into token ids before the cache sees them",
    "model_config.tokenizer_revision": "turns text into token ids before the cache sees them",
    "model_config.skip_tokenizer_init": "turns text into token ids before the cache sees them",
    "model_config.renderer_num_workers": "turns text into token ids before the cache sees them",
    "model_config.served_model_name": "the name the API answers to",
    "model_config.hf_token": "a credential: never stored",
    "model_config.allowed_local_media_path": "where multimodal inputs may be fetched from",
    "model_config.allowed_media_domains": "where multimodal inputs may be fetched from",
    "model_config.max_logprobs": _SAMPLING,
    "model_config.logprobs_mode": _SAMPLING,
    "model_config.return_sampling_mask": _SAMPLING,
    "model_config.use_fp64_gumbel": _SAMPLING,
    "model_config.logits_processors": _SAMPLING,
    "model_config.generation_config": _SAMPLING,
    "model_config.override_generation_config": _SAMPLING,
    "model_config.enable_sleep_mode": "frees and restores memory between requests",
    "model_config.sleep_preserve_parameter_names": "frees and restores memory between requests",
    "model_config.sleep_mode_backend": "frees and restores memory between requests",
    "model_config.sleep_mode_offload_cudagraph": "frees and restores memory between requests",
    "model_config.enable_nccl_comm_suspend": "frees and restores memory between requests",
    "model_config.enable_cumem_allocator": "frees and restores memory between requests",
    **{f"model_config.{c}.{k}": why for c in ("hf_config", "hf_text_config") for k, why in _HF_METADATA.items()},
    "cache_config.gpu_memory_utilization": "how many blocks the engine holds, not what a block holds",
    "cache_config.num_gpu_blocks_override": "how many blocks the engine holds, not what a block holds",
    "cache_config.num_gpu_blocks": "how many blocks the engine holds, not what a block holds",
    "cache_config.num_cpu_blocks": "how many blocks the engine holds, not what a block holds",
    "cache_config.kv_cache_memory_bytes": "how many blocks the engine holds, not what a block holds",
    "cache_config.kv_cache_size_tokens": "how many blocks the engine holds, not what a block holds",
    "cache_config.kv_cache_max_concurrency": "how many blocks the engine holds, not what a block holds",
    "cache_config.kv_offloading_size": "the offloading tiers' own sizes",
    "cache_config.kv_offloading_backend": "the offloading tiers' own choice",
    "cache_config.enable_prefix_caching": "which blocks are kept, not what a block holds",
    "cache_config.prefix_cache_retention_interval": "which blocks are kept, not what a block holds",
    "cache_config.prefix_caching_hash_algo": "how blocks are keyed: vLLM's keys change with it already",
    "cache_config.user_specified_block_size": "how block_size was chosen; block_size itself is kept",
    "cache_config._block_size_resolved": "how block_size was chosen; block_size itself is kept",
    "load_config.download_dir": "where weights are downloaded to: their bytes are digested",
    "load_config.safetensors_load_strategy": "how weight files are read: their bytes are digested",
    "load_config.safetensors_prefetch_block_size": "how weight files are read: their bytes are digested",
    "load_config.safetensors_prefetch_num_threads": "how weight files are read: their bytes are digested",
}


def resolved_vllm_config(vllm_config: Any) -> dict[str, Any]:
    """The identity document of a `VllmConfig`: every field as vLLM resolved it, but `VLLM_EXCLUDED`."""
    return canonical(vllm_config, VLLM_EXCLUDED)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkLayout:
    """The bytes of one offloaded chunk as vLLM's workers lay them out in the primary tier's rows."""

    kv_dtype: str
    kv_cache_layout: str
    chunk_bytes: int
    worker_kv_bytes_per_block: int
    blocks_per_chunk: int
    tokens_per_hash: int
    parallel: str

    def describe(self, plans: Sequence[GroupPlan]) -> str:
        groups = ",".join(p.describe() for p in plans)
        return (
            f"{self.kv_dtype};layout={self.kv_cache_layout};chunk={self.chunk_bytes}B/{self.blocks_per_chunk}blk;"
            f"block={self.worker_kv_bytes_per_block}B;hash={self.tokens_per_hash}t;{self.parallel};groups={groups}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class EngineIdentity:
    """The namespace's version key, each group's plan, and each group's layout digest."""

    version_key: VersionKey
    plans: Mapping[int, GroupPlan]
    layout_digests: Mapping[int, bytes]

    @property
    def namespace(self) -> bytes:
        return self.version_key.namespace


def derive_identity(
    model_id: str,
    model_dir: Path,
    groups: Sequence[EngineGroup],
    layout: ChunkLayout,
    kernel_abi: str,
    resolved: Mapping[str, Any],
    weights: str | None = None,
) -> EngineIdentity:
    """Namespace and group plans of one engine from its resolved configuration (`resolved_vllm_config`).

    The groups are classified by the resolved model config (launch-time overrides included), never by the
    checkpoint's config.json; the whole resolved document's digest is the key's `engine_config`. `model_dir`
    is read for the weights' bytes only; `weights` skips that (a digest the operator computed)."""
    if not model_dir.is_dir():
        raise VllmTierError(
            f"model '{model_id}' is not a local checkpoint directory: set model_dir in the kvtier tier config "
            "to the snapshot directory vLLM loads"
        )
    hf_config = resolved_hf_config(resolved)
    plans = plan_groups(groups, hf_config, layout.blocks_per_chunk)
    ordered = [plans[g] for g in sorted(plans)]
    dtype_layout = layout.describe(ordered)
    key = VersionKey(
        model_id=model_id,
        weights_digest=weights or weights_digest(model_dir),
        kernel_abi=kernel_abi,
        compression_version=IN_ENGINE_CONFIG,
        indexer_version=IN_ENGINE_CONFIG,
        dtype_layout=dtype_layout,
        engine_config=digest(resolved),
    )
    digests = {
        p.group_id: hashlib.blake2b(
            f"{kernel_abi}|{dtype_layout}|{p.describe()}".encode(), digest_size=16, person=b"kvtier-vllm-lay1"
        ).digest()
        for p in ordered
    }
    return EngineIdentity(key, plans, digests)


def resolved_hf_config(resolved: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's resolved Hugging Face config inside a resolved vLLM config document."""
    model = resolved.get("model_config")
    hf = model.get("hf_text_config") if isinstance(model, Mapping) else None
    if not isinstance(hf, Mapping):
        raise VllmTierError("the engine's resolved configuration has no model_config.hf_text_config: cannot classify")
    return hf
