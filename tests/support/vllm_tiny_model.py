"""Random tiny checkpoints, written at test time: big enough weights that wrong KV changes tokens."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
GEMMA2_WINDOW = 64  # tokens: two 32-token blocks
# Gemma ties its output to its embedding, scaled by sqrt(hidden) on input: large embeddings make it echo the
# last token, so its embedding is drawn small and attention (the KV under test) decides the next token.
EMBED_STD = {"llama": 0.25, "gemma2": 0.02}


def _config(arch: str):
    """2 layers, hidden 64, 2 heads of 32, vocab 512; gemma2: layer 0 sliding (window 64), layer 1 full."""
    from transformers import Gemma2Config, LlamaConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=False, **common)
    if arch == "gemma2":
        return Gemma2Config(
            sliding_window=GEMMA2_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=32,
            **common,
        )
    raise ValueError(f"unknown test architecture {arch!r}")


def write_checkpoint(path: Path, seed: int, arch: str = "llama") -> Path:
    """Weights ~N(0, 0.25) (embeddings: EMBED_STD; norms keep their init), bf16 safetensors; overwrites `path`."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * (EMBED_STD[arch] if "embed" in name else 0.25))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path
