"""Seeded deterministic weights: the trunk from (seed, model, weights digest); compressors and indexers also from
their versions."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from kvtier.core.versions import VersionKey
from kvtier.refmodel.config import CompressedSpec, RefConfig, SwaSpec


@dataclasses.dataclass(frozen=True, slots=True)
class SwaWeights:
    wq: torch.Tensor  # (d_model, heads * head_dim)
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor  # (heads * head_dim, d_model)


@dataclasses.dataclass(frozen=True, slots=True)
class CompressorWeights:
    """Overlapping gated pooling: each row pools 2 * ratio tokens, the earlier half with (kv_a, sc_a), the later
    with (kv_b, sc_b)."""

    proj: torch.Tensor  # (d_model, 4 * latent): columns [kv_a | sc_a | kv_b | sc_b]
    ape: torch.Tensor  # (2 * ratio, latent): per-position score bias


@dataclasses.dataclass(frozen=True, slots=True)
class IndexerWeights:
    wq: torch.Tensor  # (d_model, index_dim): the query of each token
    wk: torch.Tensor  # (latent, index_dim): the key of each compressed row


@dataclasses.dataclass(frozen=True, slots=True)
class CompressedWeights:
    wq: torch.Tensor  # (d_model, heads * latent): queries over the shared K=V latent (MQA)
    wraw: torch.Tensor  # (d_model, latent): raw latent of the tokens not yet compressed
    wo: torch.Tensor  # (heads * latent, d_model)
    compressor: CompressorWeights
    indexer: IndexerWeights | None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockWeights:
    attn: SwaWeights | CompressedWeights
    w1: torch.Tensor  # (d_model, ffn_dim)
    w2: torch.Tensor  # (ffn_dim, d_model)


@dataclasses.dataclass(frozen=True, slots=True)
class RefWeights:
    embed: torch.Tensor  # (vocab, d_model)
    blocks: tuple[BlockWeights, ...]
    lm_head: torch.Tensor  # (d_model, vocab)


def _generator(*parts: object) -> torch.Generator:
    """A torch generator seeded from a stable digest of `parts` (no Python hash(), same in every process)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8, person=b"kvtier-refw-v1").digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little") >> 1)
    return gen


def _dense(gen: torch.Generator, fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(fan_in, fan_out, generator=gen) * (gain / math.sqrt(fan_in))


def build_weights(cfg: RefConfig, version: VersionKey) -> RefWeights:
    """All weights for `version`; bumping the compression or indexer version changes only those parts."""
    trunk = (cfg.seed, version.model_id, version.weights_digest)
    d, out_gain = cfg.d_model, 1.0 / math.sqrt(2 * len(cfg.layers))
    blocks = []
    for spec in cfg.layers:
        gen = _generator(*trunk, "layer", spec.layer)
        attn: SwaWeights | CompressedWeights
        if isinstance(spec, SwaSpec):
            inner = cfg.n_heads * cfg.head_dim
            attn = SwaWeights(
                _dense(gen, d, inner), _dense(gen, d, inner), _dense(gen, d, inner), _dense(gen, inner, d, out_gain)
            )
        else:
            attn = _compressed(cfg, spec, version, gen, out_gain)
        blocks.append(BlockWeights(attn, _dense(gen, d, cfg.ffn_dim), _dense(gen, cfg.ffn_dim, d, out_gain)))
    gen = _generator(*trunk, "embed")
    return RefWeights(torch.randn(cfg.vocab_size, d, generator=gen), tuple(blocks), _dense(gen, d, cfg.vocab_size))


def _compressed(
    cfg: RefConfig, spec: CompressedSpec, version: VersionKey, gen: torch.Generator, out_gain: float
) -> CompressedWeights:
    d, lat = cfg.d_model, cfg.latent_dim
    wq, wraw, wo = _dense(gen, d, cfg.n_heads * lat), _dense(gen, d, lat), _dense(gen, cfg.n_heads * lat, d, out_gain)
    cgen = _generator(
        cfg.seed, version.model_id, version.weights_digest, version.compression_version, "compressor", spec.layer
    )
    compressor = CompressorWeights(_dense(cgen, d, 4 * lat), 0.5 * torch.randn(2 * spec.ratio, lat, generator=cgen))
    indexer = None
    if spec.sparse:
        igen = _generator(
            cfg.seed, version.model_id, version.weights_digest, version.indexer_version, "indexer", spec.layer
        )
        indexer = IndexerWeights(_dense(igen, d, cfg.index_dim), _dense(igen, lat, cfg.index_dim))
    return CompressedWeights(wq, wraw, wo, compressor, indexer)
