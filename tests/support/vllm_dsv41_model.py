"""A DeepSeek-V4.1-shaped checkpoint: `config.json` as vLLM 0.32's `DeepseekV41Config` reads it (no vLLM needed).

V4.1 differs from V4 where kvtier looks: compression ratios 0 (sliding window only), 1 (a full-length
compressed cache) and 2; compressed KV, its compressor and the indexer keys live only on the
`kv_source_layer_ids` (every other compressed layer reads the latest source below it); indexers run only
on `index_source_layer_ids` (a non-source indexer scores the keys of the latest KV source below it). The
text model's keys nest under `text_config`, as in the released checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

LAYERS = 43  # enough sliding-window caches that vLLM splits them over two groups
RATIOS = [0, 0] + [2] * 20 + [1] * 20 + [0]
KV_SOURCES = [2, 12, 22, 32]  # every other compressed layer reads the latest of these below it
INDEX_SOURCES = [2, 7, 22, 27]  # 2 and 22 own indexer keys (they are KV sources); 7 and 27 score theirs


def dsv41_text_config(**overrides: object) -> dict:
    config = {
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 64,
        "hidden_size": 4096,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "sliding_window": 128,
        "compress_ratios": RATIOS,
        "kv_source_layer_ids": KV_SOURCES,
        "index_source_layer_ids": INDEX_SOURCES,
        "candidate_source_layer_id": 22,
        "candidate_topk_blocks": 8,
        "candidate_block_size": 64,
        "compress_rope_theta": 160000,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "rms_norm_eps": 1e-6,
        "vocab_size": 129280,
        "max_position_embeddings": 65536,
    }
    config.update(overrides)
    return config


def dsv41_config(**overrides: object) -> dict:
    """The checkpoint's config.json; `overrides` go into `text_config`."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "torch_dtype": "bfloat16",
        "text_config": dsv41_text_config(**overrides),
    }


def write_dsv41_checkpoint(path: Path, weights: bytes = b"dsv41 weights" * 512, **overrides: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dsv41_config(**overrides)))
    (path / "model.safetensors").write_bytes(weights)
    return path
