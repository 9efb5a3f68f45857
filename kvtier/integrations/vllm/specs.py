"""vLLM's KV cache groups as kvtier `EngineGroup`s carrying each layer's cache spec (imports vLLM).

vLLM's offloading config names the groups a secondary tier receives and their layers; its `KVCacheConfig`
says what each group's layers cache (block size, sliding window, tokens per stored row, page bytes). This
module copies those spec fields into plain `LayerSpec`s; the rules that turn them into kvtier forms live
in groups.py, which stays free of vLLM.
"""

from __future__ import annotations

from fractions import Fraction

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.vllm.groups import EngineGroup, LayerSpec


def _family(spec: KVCacheSpec) -> str:
    # Subclasses first: a ring and a sliding window are AttentionSpecs too; FullAttentionSpec's own
    # `sliding_window` (hybrid allocator off) still keeps a block for every token, so it stays "attention".
    if isinstance(spec, CircularBufferSpec):
        return "ring"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked_local"
    if isinstance(spec, FullAttentionSpec):
        return "attention"
    if isinstance(spec, MambaSpec):
        return "mamba"
    return "other"


def _tokens_per_state(spec: KVCacheSpec) -> str:
    try:
        value = spec.tokens_per_state
    except NotImplementedError:  # specs without per-token rows (Mamba)
        return "-"
    return str(Fraction(value)) if isinstance(value, Fraction) else str(int(value))


def layer_spec(spec: KVCacheSpec) -> LayerSpec:
    """The plain fields of one layer's (or one merged group's) vLLM cache spec."""
    family = _family(spec)
    return LayerSpec(
        family=family,
        spec_class=type(spec).__name__,
        block_size=int(spec.block_size),
        sliding_window=int(spec.sliding_window) if family == "sliding_window" else 0,
        tokens_per_state=_tokens_per_state(spec),
        page_bytes=int(spec.page_size_bytes),
        dtype=str(getattr(spec, "dtype", "")).removeprefix("torch.") if isinstance(spec, AttentionSpec) else "",
        cache_dtype=str(getattr(spec, "cache_dtype_str", None) or ""),
        prefix_cacheable=bool(spec.prefix_cacheable),
    )


def engine_groups(offloading_config: OffloadingConfig, kv_cache_config: KVCacheConfig) -> list[EngineGroup]:
    """One `EngineGroup` per group vLLM offloads, with its layers' specs from `kv_cache_config`.

    A worker-side config keeps one spec per layer (`UniformTypeKVCacheSpecs`); the scheduler-side config
    keeps one merged spec per group, which then stands for every layer of the group. A group the two configs
    disagree on is refused: the specs would describe some other engine's caches.
    """
    vllm_groups = kv_cache_config.kv_cache_groups
    out = []
    for g in offloading_config.groups:
        if not 0 <= g.group_id < len(vllm_groups):
            raise VllmTierError(
                f"vLLM's offloading config names KV group {g.group_id} but its KVCacheConfig has "
                f"{len(vllm_groups)} groups: pass the KVCacheConfig the connector was built with"
            )
        group = vllm_groups[g.group_id]
        if tuple(group.layer_names) != tuple(g.layer_names):
            raise VllmTierError(
                f"KV group {g.group_id}: the offloading config's layers ({', '.join(g.layer_names[:3])}, ...) "
                "are not the KVCacheConfig's: pass the KVCacheConfig the connector was built with"
            )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            missing = [n for n in g.layer_names if n not in spec.kv_cache_specs]
            if missing:
                raise VllmTierError(f"KV group {g.group_id} has no spec for layer '{missing[0]}' in vLLM's config")
            specs = tuple(layer_spec(spec.kv_cache_specs[n]) for n in g.layer_names)
        else:
            specs = (layer_spec(spec),)
        out.append(EngineGroup(g.group_id, g.tokens_per_block, tuple(g.layer_names), specs))
    return out
