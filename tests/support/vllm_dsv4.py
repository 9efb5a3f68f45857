"""DeepSeek-V4's KV groups as vLLM 0.32 itself forms them, and the connector's calls on a tier over them (needs vLLM).

The per-layer specs come from vLLM's real DSV4 cache modules (`DeepseekV4SWACache`, `DeepseekV4IndexerCache`,
`CompressorStateCache`; the attention layer's own `get_kv_cache_spec`) under the block-outermost layout, and
vLLM's `get_kv_cache_groups` groups them: no group layout is written down here. `ChunkKeys`, `scan` and
`run_job` make the calls vLLM's connector makes on a secondary tier, for driving a tier without a scheduler
(bench/vllm_dsv4.py; the tests use vLLM's Scheduler itself, support/vllm_dsv4_engine.py).
"""

from __future__ import annotations

import hashlib
import itertools
import types
from pathlib import Path

import numpy as np
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
from vllm.models.deepseek_v4.compressor import CompressorStateCache
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from kvtier.integrations.vllm.tier import KvtierSecondaryTier
from support.vllm_dsv4_model import LAYERS, RATIOS

INDEXER_ROW = 132  # fp8 indexer key: 128 B + 4 B scale


def dsv4_layer_specs(model_dir: Path, **vllm_config: object) -> tuple[VllmConfig, dict]:
    """vLLM's config for the checkpoint (`vllm_config`: more VllmConfig fields) and each KV layer's spec, from the
    real cache modules."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=8192)
    cache = CacheConfig(block_size=256, cache_dtype="fp8_ds_mla")
    cache.kv_cache_layout = "BLHNC"  # block-outermost: groups overlay one packed block
    config = VllmConfig(model_config=model, cache_config=cache, **vllm_config)
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


def dsv4_offloading_config(model_dir: Path, row_bytes: int | None = None) -> tuple[OffloadingConfig, int, VllmConfig]:
    """The OffloadingConfig vLLM's connector hands a secondary tier for this checkpoint, vLLM's packed block bytes,
    and the VllmConfig it describes (a tier built outside vLLM's connector is handed it as `vllm_config`).

    `row_bytes` replaces the packed block size in the config (tests keep rows small; the groups stay vLLM's).
    """
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", engine_id="dsv4")
    config, specs = dsv4_layer_specs(model_dir, kv_transfer_config=transfer)
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
    return offloading, block_bytes, config


def block_hashes(seed: int, n: int, shared: int = 0, base_seed: int = 0) -> list[bytes]:
    """vLLM-style chained hashes of `n` 4-token hash blocks; the first `shared` equal those of `base_seed`."""
    out, h = [], b""
    for i in range(n):
        s = base_seed if i < shared else seed
        h = hashlib.sha256(h + s.to_bytes(4, "big") + i.to_bytes(4, "big")).digest()
        out.append(h)
    return out


class ChunkKeys:
    """One prompt's keys per group, registered in a ReqContext with their end tokens as vLLM's connector does."""

    def __init__(self, config: OffloadingConfig, hashes: list[bytes], name: str) -> None:
        self.ctx = ReqContext(name)
        self.keys: dict[int, list[bytes]] = {}
        for g in config.groups:
            per = g.tokens_per_block // 4
            self.keys[g.group_id] = []
            for end_hash in range(per - 1, len(hashes), per):
                key = make_offload_key(hashes[end_hash], g.group_id)
                self.keys[g.group_id].append(key)
                self.ctx.set_offload_key_position(key, (end_hash + 1) * 4)


def scan(tier: KvtierSecondaryTier, req: ChunkKeys, group: int, window: int) -> int:
    """Tokens vLLM's connector would take from this group: a prefix (window 0) or the last whole window."""
    keys, t = req.keys[group], tier._plans[group].tokens_per_chunk
    if window == 0:
        n = 0
        while n < len(keys) and tier.lookup(keys[n], req.ctx) is LookupResult.HIT:
            n += 1
        return n * t
    run = 0
    for i in range(len(keys) - 1, -1, -1):
        run = run + 1 if tier.lookup(keys[i], req.ctx) is LookupResult.HIT else 0
        if run == window:
            return (i + window) * t
    return 0


_job_ids = itertools.count()


def run_job(tier: KvtierSecondaryTier, keys: list[bytes], chunks: list[int], ctx: ReqContext, load: bool) -> JobResult:
    """Submit one load or store job to the tier, wait for its workers, and return its result."""
    job = TransferJob(next(_job_ids), keys, np.array(chunks, dtype=np.int32), load, ctx)
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    (result,) = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
    return result
