"""A DeepSeek-V4-Flash-shaped `config.json` and the five KV groups vLLM 0.32 forms for it (no vLLM needed).

The group layout is the one vLLM's packed (block-outermost) grouping gives for this config: two SWA groups,
one history group (C4 + C128 attention + indexer keys), C4 compressor states (attention + indexer), C128
compressor states. Group ids follow layer registration order in vLLM, so callers may permute them.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.integrations.vllm.groups import EngineGroup

LAYERS = 43
RATIOS = [0, 0] + [4, 128] * 20 + [4]  # 21 C4 + 20 C128 layers; the first two are SWA only


def dsv4_config(**overrides: object) -> dict:
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
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
        "compress_rope_theta": 160000,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "vocab_size": 129280,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def write_dsv4_checkpoint(path: Path, weights: bytes = b"dsv4 weights" * 512, **overrides: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dsv4_config(**overrides)))
    (path / "model.safetensors").write_bytes(weights)
    return path


def dsv4_groups(ids: tuple[int, int, int, int, int] = (0, 1, 2, 3, 4)) -> list[EngineGroup]:
    """(swa A, swa B, history, C4 states, C128 states) with the given vLLM group ids."""

    def attn(i: int) -> str:
        return f"model.layers.{i}.attn"

    c4 = [i for i, r in enumerate(RATIOS) if r == 4]
    c128 = [i for i, r in enumerate(RATIOS) if r == 128]
    swa = [f"{attn(i)}.swa_cache" for i in range(LAYERS)]
    history = [attn(i) for i in c4 + c128] + [f"{attn(i)}.indexer.k_cache" for i in c4]
    c4_states = [f"{attn(i)}.compressor.state_cache" for i in c4] + [
        f"{attn(i)}.indexer.compressor.state_cache" for i in c4
    ]
    c128_states = [f"{attn(i)}.compressor.state_cache" for i in c128]
    return [
        EngineGroup(ids[0], 64, tuple(swa[0::2])),
        EngineGroup(ids[1], 64, tuple(swa[1::2])),
        EngineGroup(ids[2], 256, tuple(history)),
        EngineGroup(ids[3], 4, tuple(c4_states)),
        EngineGroup(ids[4], 8, tuple(c128_states)),
    ]
