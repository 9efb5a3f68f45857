"""The engine identity behind an SGLang HiCache backend's namespace. Plain Python: imports no SGLang.

The identity is what the engine resolved, never what a file on disk says: SGLang's server arguments as
resolved for this process (after `--json-model-override-args`, `--kv-cache-dtype`, quantization, page
size and SGLang's own model-specific defaults) and the `ModelConfig` SGLang built from them (its
`hf_config` carries the overrides). Both are rendered whole by `resolved_config.canonical`; only the
paths in `EXCLUDED` are left out, each with the reason it cannot change a cached KV byte, so a field a
future SGLang adds changes the namespace (a miss) instead of being ignored (a hit on bytes another
configuration wrote). The weights are digested by their bytes. docs/sglang.md lists the same table.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from kvtier.core.versions import VersionKey
from kvtier.integrations.errors import UnrenderableConfig
from kvtier.integrations.resolved_config import canonical, digest
from kvtier.integrations.sglang.pools import SglangStorageError

# config keys that change what the compressor (and the windows around it) or the indexer write: named
# apart in the version key for audits; the whole resolved config is in `engine_config` as well.
_COMPRESSOR_KEYS = re.compile(r"compress|window|kv_lora_rank|rope_head_dim|head_dim")
_INDEXER_KEYS = re.compile(r"index")

_SCHEDULING = (
    "how many requests or tokens run at once, in which order and when: it decides when a page is computed, "
    "never which bytes a page of given tokens holds"
)
_CACHE_SIZING = "the size or policy of SGLang's own caches around the pages, not the pages' bytes"
_PLACEMENT = "where or how the processes start and talk to each other; a rank's shard is in storage.shard"

# Dotted paths of the identity document left out of the namespace, and why each cannot change a KV byte.
EXCLUDED: dict[str, str] = {
    # Whole SGLang namespaces (SGLang's own grouping of its server arguments).
    "server_args.serving": (
        "the HTTP/gRPC front end, API keys, chat templates, tokenizer and detokenizer, streaming and sampling "
        "defaults: they act on text before it becomes token ids or on logits after the forward; kvtier keys "
        "pages by token ids (and keeps API keys and passwords out of the namespace's audit document)"
    ),
    "server_args.observability": "logging, metrics, tracing and profiling: they read what the engine did",
    # device
    "server_args.device.random_seed": (
        "the sampler's seed (SGLang draws a new one per launch when it is unset): a cached page is keyed by "
        "its tokens, whichever way they were sampled"
    ),
    "server_args.device.watchdog_timeout": "a hang detector's deadline",
    "server_args.device.soft_watchdog_timeout": "a hang detector's deadline",
    "server_args.device.gc_threshold": "Python's garbage collector thresholds",
    "server_args.device.numa_node": "CPU memory placement of the process",
    "server_args.device.base_gpu_id": "which GPU index a rank starts at, not what it computes",
    "server_args.device.gpu_id_step": "which GPU index a rank starts at, not what it computes",
    "server_args.device.sleep_on_idle": "whether an idle scheduler sleeps",
    "server_args.device.custom_sigquit_handler": "a signal handler",
    "server_args.device.use_ray": _PLACEMENT,
    # parallel: addresses and ports (the widths stay in: they change a rank's shard of the KV)
    "server_args.parallel.dist_init_addr": _PLACEMENT,
    "server_args.parallel.nccl_port": _PLACEMENT,
    "server_args.parallel.dist_timeout": _PLACEMENT,
    "server_args.parallel.gated_launch_port": _PLACEMENT,
    "server_args.parallel.node_rank": _PLACEMENT,
    "server_args.parallel.load_balance_method": "how data-parallel replicas share requests",
    # schedule (page_size, c128_page_size and the SWA / Mamba layout fields stay in)
    **{
        f"server_args.schedule.{name}": _SCHEDULING
        for name in (
            "max_running_requests",
            "max_queued_requests",
            "max_total_tokens",
            "max_prefill_tokens",
            "prefill_max_requests",
            "chunked_prefill_size",
            "mem_fraction_static",
            "schedule_policy",
            "schedule_conservativeness",
            "schedule_low_priority_values_first",
            "enable_priority_scheduling",
            "abort_on_priority_when_disabled",
            "default_priority_value",
            "disable_priority_preemption",
            "priority_scheduling_preemption_threshold",
            "retraction_policy",
            "num_continuous_decode_steps",
            "scheduler_recv_interval",
            "min_free_slots_delay",
            "prefill_decode_interval",
            "prefill_decode_interval_min_bs",
            "enable_prefill_delayer",
            "prefill_delayer_max_delay_ms",
            "prefill_delayer_max_delay_passes",
            "prefill_delayer_queue_min_ratio",
            "prefill_delayer_token_usage_low_watermark",
            "prefill_delayer_forward_passes_buckets",
            "prefill_delayer_wait_seconds_buckets",
            "disable_overlap_schedule",
        )
    },
    # memory: the cache tiers' sizes and policies (their layouts stay in)
    "server_args.memory.hicache_storage_backend_extra_config": (
        "the storage backend's own options: kvtier's store location, daemon socket and queue sizes (its "
        "weights_digest is the version key's weights digest)"
    ),
    **{
        f"server_args.memory.{name}": _CACHE_SIZING
        for name in (
            "hicache_ratio",
            "hicache_size",
            "hicache_host_memory_fraction",
            "hicache_storage_prefetch_policy",
            "hicache_storage_prefetch_retry_max_attempts",
            "hicache_storage_prefetch_retry_poll_interval",
            "hicache_write_policy",
            "radix_eviction_policy",
            "radix_eviction_policy_config",
            "_radix_eviction_policy_explicitly_set",
        )
    },
    # model: where the weights come from (their bytes are the version key's weights digest)
    "server_args.model.download_dir": "where downloaded weights are kept; the weights are digested by their bytes",
    "server_args.model.delete_ckpt_after_loading": "whether the checkpoint files are deleted once loaded",
    "server_args.model.engine_info_bootstrap_port": _PLACEMENT,
    "server_args.model.checkpoint_engine_wait_weights_before_ready": "when the server reports ready",
    "server_args.model.remote_instance_weight_loader_seed_instance_ip": _PLACEMENT,
    "server_args.model.remote_instance_weight_loader_seed_instance_service_port": _PLACEMENT,
    "server_args.model.remote_instance_weight_loader_send_weights_group_ports": _PLACEMENT,
    "server_args.model.modelopt_checkpoint_save_path": "where a quantized checkpoint is written (an output)",
    "server_args.model.modelopt_export_path": "where a quantized checkpoint is written (an output)",
    # ModelConfig: sampling and output handling only
    "model_config.sampling_defaults": "which sampling defaults the server applies",
    "model_config.hf_generation_config": "generation_config.json: sampling defaults and stop ids",
    "model_config.hf_eos_token_id": "when generation stops",
    "model_config.think_end_ids": "the reasoning parser's markers in the output",
    "model_config.self_opened_think_start_ids": "the reasoning parser's markers in the output",
    "model_config.request_selectable_think_end_id_sequences": "the reasoning parser's markers in the output",
}


def server_args_tree(resolved: Mapping[str, Any], namespaces: Mapping[str, str]) -> dict[str, Any]:
    """SGLang's resolved server arguments nested by SGLang's namespace of each (`exec.kernel`, `schedule`, ...).

    A field SGLang places in no namespace goes under `unplaced`, and is kept like any other.
    """
    tree: dict[str, Any] = {}
    for name, value in resolved.items():
        node = tree
        for part in namespaces.get(name, "unplaced").split("."):
            node = node.setdefault(part, {})
        node[name] = value
    return tree


def identity_document(
    server_args: Mapping[str, Any],
    model_config: Mapping[str, Any],
    storage: Mapping[str, Any],
    pools: Mapping[str, Any],
) -> dict[str, Any]:
    """The canonical identity: every resolved field but `EXCLUDED`; refuses what it cannot render."""
    doc = {"server_args": server_args, "model_config": model_config, "storage": storage, "pools": pools}
    try:
        return canonical(doc, EXCLUDED)
    except UnrenderableConfig as exc:
        raise SglangStorageError(f"cannot identify SGLang's resolved configuration: {exc}") from None


def config_digest(cfg: Mapping[str, Any], pattern: re.Pattern[str]) -> str:
    """blake2b-16 over the config entries whose key matches `pattern`, or 'none' when none does."""
    picked = {k: v for k, v in cfg.items() if pattern.search(k)}
    if not picked:
        return "none"
    text = json.dumps(picked, sort_keys=True, separators=(",", ":")).encode()
    return "blake2b16:" + hashlib.blake2b(text, digest_size=16).hexdigest()


def version_key(doc: Mapping[str, Any], *, model_id: str, weights: str, sglang_version: str) -> VersionKey:
    """The namespace's version key: the weights' digest, SGLang's version and the identity document's digest.

    The compressor and indexer fields and the KV layout are named apart (from the same resolved document)
    so an audit shows at a glance which of them differs between two namespaces.
    """
    text_config = doc["model_config"].get("hf_text_config") or {}
    sched = doc["server_args"].get("schedule", {})
    model = doc["server_args"].get("model", {})
    storage = doc["storage"]
    layout = (
        f"kv={model.get('kv_cache_dtype')};page={sched.get('page_size')}t;mla={int(bool(storage['is_mla_model']))};"
        f"page_first={int(bool(storage['is_page_first_layout']))};shard={storage['shard']}"
    )
    return VersionKey(
        model_id=model_id,
        weights_digest=weights,
        kernel_abi=f"sglang-{sglang_version}",
        compression_version=config_digest(text_config, _COMPRESSOR_KEYS),
        indexer_version=config_digest(text_config, _INDEXER_KEYS),
        dtype_layout=layout,
        engine_config=digest(doc),
    )
