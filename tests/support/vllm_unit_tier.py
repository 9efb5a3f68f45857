"""The kvtier vLLM tier built the way vLLM's connector builds it, without an engine: a Gemma2-shaped
OffloadingConfig (layer 0 sliding, window 64; layer 1 full) over a primary buffer, for the tests that drive
the tier's jobs directly (test_vllm_tier_unit.py, test_vllm_events.py). Import after `require_vllm()`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtier.integrations.vllm.tier import KvtierSecondaryTier
from support.vllm_engine_run import engine_kwargs
from support.vllm_tiny_model import write_checkpoint

ROW = 8192
CHUNKS = 16
T = 32  # tokens per chunk
FULL, SWA = 1, 0  # vLLM group ids, as in a Gemma2: layer 0 sliding (window 64), layer 1 full


def write_model(path: Path, weights: bytes) -> Path:
    """The checkpoint files the tier digests (`model_dir`): a Gemma2-shaped config.json and `weights`."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "num_attention_heads": 2,
        "head_dim": 32,
        "hidden_size": 64,
        "sliding_window": 2 * T,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(weights)
    return path


def gemma2_engine(folder: Path) -> VllmConfig:
    """What a Gemma2 engine resolved (a tiny checkpoint written into `folder`), as vLLM builds it."""
    model = write_checkpoint(folder, seed=1, arch="gemma2")
    args = engine_kwargs(str(model), [])
    args["kv_transfer_config"] = {**args["kv_transfer_config"], "engine_id": "unit"}
    return EngineArgs(**args).create_engine_config()


def make_tier(
    weights: Path,
    store: Path | None,
    primary: np.ndarray,
    engine: VllmConfig,
    *,
    vllm_events: bool = False,
    **options,
) -> KvtierSecondaryTier:
    """A tier for the engine `engine` describes, its weights digested from `weights` (the model_dir option),
    over the store folder `store` (None: `options` name `store_dir` or `daemon_socket`); `vllm_events` is
    vLLM's own `enable_kv_cache_events`. The tier is handed `engine` as its `vllm_config` unless `options`
    name another (or None)."""
    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(T, ("model.layers.0.self_attn.attn",), SWA),
            OffloadingGroupConfig(T, ("model.layers.1.self_attn.attn",), FULL),
        ),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=vllm_events,
        extra_config={},
        engine_id="unit",
        model=OffloadingModelConfig(name=engine.model_config.model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=T, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        kv_cache_layout="NHD",
    )
    if store is not None:
        options = {"store_dir": str(store), **options}
    return KvtierSecondaryTier(
        SimpleNamespace(config=config),
        memoryview(primary),
        "KvtierSecondaryTier",
        model_dir=str(weights),
        **{"vllm_config": engine, **options},
    )
