"""A random tiny Llama checkpoint, written at test time: big enough weights that wrong KV changes tokens."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def write_checkpoint(path: Path, seed: int) -> Path:
    """2 layers, hidden 64, 2 heads of 32, vocab 512, weights ~N(0, 0.25) (norms stay 1), bf16 safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.25)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path
