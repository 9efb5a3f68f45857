"""DeepSeek-V4's KV groups as vLLM 0.32 itself forms them, and a kvtier tier over them (needs vLLM).

The per-layer specs come from vLLM's real DSV4 cache modules (`DeepseekV4SWACache`, `DeepseekV4IndexerCache`,
`CompressorStateCache`; the attention layer's own `get_kv_cache_spec`) under the block-outermost layout, and
vLLM's `get_kv_cache_groups` groups them: no group layout is written down here.
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
from vllm.models.deepseek_v4.compressor import CompressorStateCache
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from support.vllm_dsv4_model import LAYERS, RATIOS

INDEXER_ROW = 132  # fp8 indexer key: 128 B + 4 B scale


def dsv4_layer_specs(model_dir: Path) -> tuple[VllmConfig, dict]:
    """vLLM's config for the checkpoint and each KV layer's spec, from the real cache modules."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=8192)
    cache = CacheConfig(block_size=256, cache_dtype="fp8_ds_mla")
    cache.kv_cache_layout = "BLHNC"  # block-outermost: groups overlay one packed block
    config = VllmConfig(model_config=model, cache_config=cache)
    hf = model.hf_config
    specs = {}
    with set_current_vllm_config(config):
        for i in range(LAYERS):
            ratio, attn = RATIOS[i], f"model.layers.{i}.attn"
            modules = [
                DeepseekV4SWACache(hf.head_dim, hf.sliding_window, torch.uint8, f"{attn}.swa_cache", cache, object)
            ]
            if ratio > 1:
                layer = types.SimpleNamespace(
                    compress_ratio=ratio, kv_cache_dtype="fp8_ds_mla", head_dim=hf.head_dim, kv_cache_torch_dtype=None
                )
                specs[attn] = DeepseekV4Attention.get_kv_cache_spec(layer, config)
                coff = 2 if ratio == 4 else 1
                modules.append(
                    CompressorStateCache(2 * coff * hf.head_dim, torch.float32, ratio, f"{attn}.compressor.state_cache")
                )
            if ratio == 4:
                modules.append(
                    DeepseekV4IndexerCache(INDEXER_ROW, torch.uint8, f"{attn}.indexer.k_cache", cache, ratio)
                )
                modules.append(
                    CompressorStateCache(
                        4 * hf.index_head_dim, torch.float32, ratio, f"{attn}.indexer.compressor.state_cache"
                    )
                )
            for m in modules:
                specs[m.prefix] = m.get_kv_cache_spec(config)
    return config, specs


def dsv4_offloading_config(model_dir: Path, row_bytes: int | None = None) -> tuple[OffloadingConfig, int]:
    """The OffloadingConfig vLLM's connector hands a secondary tier for this checkpoint, and vLLM's packed block bytes.

    `row_bytes` replaces the packed block size in the config (tests keep rows small; the groups stay vLLM's).
    """
    config, specs = dsv4_layer_specs(model_dir)
    with set_current_vllm_config(config):
        groups = get_kv_cache_groups(config, specs)
        kv = get_kv_cache_config_from_groups(config, groups, 8 << 30)
    block_bytes = max(t.block_stride for t in kv.kv_cache_tensors)
    offloading = OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(g.kv_cache_spec.block_size, tuple(g.layer_names), i) for i, g in enumerate(groups)
        ),
        worker_kv_bytes_per_block=row_bytes or block_bytes,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="dsv4",
        model=OffloadingModelConfig(name=str(model_dir), dtype="fp8_ds_mla"),
        cache=OffloadingCacheConfig(tokens_per_hash=4, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        replicated_layout=True,
        kv_cache_layout="BLHNC",
    )
    return offloading, block_bytes
