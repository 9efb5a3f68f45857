"""DeepSeek-V4's five vLLM KV groups as kvtier groups, and its identity, in plain Python (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvtier.core.forms import CacheForm
from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.resolved_config import digest
from kvtier.integrations.vllm.groups import EngineGroup, dsv4_layer_kind, plan_groups
from kvtier.integrations.vllm.identity import IN_ENGINE_CONFIG, ChunkLayout, derive_identity
from support.vllm_dsv4_model import LAYERS, dsv4_config, dsv4_groups, write_dsv4_checkpoint

LAYOUT = ChunkLayout("fp8_ds_mla", "BLHNC", 1003520, 1003520, 1, 4, "agnostic;replicated=1;canonical=0")
ABI = "vllm 0.32.0;cpu;attn=dsv4"


@pytest.mark.parametrize("seed", range(4))
def test_five_groups_map_to_forms_by_their_cache_modules_whatever_their_ids(seed: int) -> None:
    ids = list(range(5))
    random.Random(seed).shuffle(ids)
    swa_a, swa_b, history, c4_states, c128_states = ids
    plans = plan_groups(dsv4_groups(tuple(ids)), dsv4_config(), blocks_per_chunk=1)
    got = {g: (p.form, p.window_tokens, p.tokens_per_chunk, p.window_chunks, p.kinds) for g, p in plans.items()}
    assert got == {
        swa_a: (CacheForm.SWA, 128, 64, 2, "swa"),
        swa_b: (CacheForm.SWA, 128, 64, 2, "swa"),
        history: (CacheForm.COMPRESSED, 0, 256, 0, "c128+c4+indexer-c4"),
        c4_states: (CacheForm.TAIL, 8, 4, 2, "c4-state+indexer-c4-state"),
        c128_states: (CacheForm.TAIL, 128, 8, 16, "c128-state"),
    }
    assert plans[history].name == f"vllm.g{history}.history"
    assert plans[c128_states].name == f"vllm.g{c128_states}.tail128"


def test_the_model_sliding_window_never_windows_the_history_group() -> None:
    """DSV4's config.json has `sliding_window: 128` and no `layer_types`: the generic rule would window every
    layer; the history group must stay a prefix from chunk 0 however the window keys are set."""
    for overrides in ({}, {"layer_types": ["sliding_attention"] * LAYERS}, {"use_sliding_window": True}):
        plans = plan_groups(dsv4_groups(), dsv4_config(**overrides), 1)
        assert plans[2].form is CacheForm.COMPRESSED and plans[2].window_tokens == 0 and plans[2].window_chunks == 0


@pytest.mark.parametrize(
    ("layer", "form", "window"),
    [
        ("model.layers.2.attn", CacheForm.COMPRESSED, 0),
        ("model.layers.3.attn", CacheForm.COMPRESSED, 0),
        ("model.layers.2.attn.indexer.k_cache", CacheForm.COMPRESSED, 0),
        ("model.layers.0.attn.swa_cache", CacheForm.SWA, 128),
        ("model.layers.2.attn.compressor.state_cache", CacheForm.TAIL, 8),
        ("model.layers.2.attn.indexer.compressor.state_cache", CacheForm.TAIL, 8),
        ("model.layers.3.attn.compressor.state_cache", CacheForm.TAIL, 128),
    ],
)
def test_each_cache_module_is_classified(layer: str, form: CacheForm, window: int) -> None:
    kind = dsv4_layer_kind(dsv4_config(), layer)
    assert (kind.form, kind.window) == (form, window)


@pytest.mark.parametrize(
    ("groups", "config", "says"),
    [
        ([EngineGroup(0, 256, ("model.layers.5.attn.mamba_cache",))], dsv4_config(), "model.layers.5.attn.mamba_cache"),
        ([EngineGroup(0, 256, ("model.layers.0.attn",))], dsv4_config(), "compress ratio 0"),  # SWA-only layer
        ([EngineGroup(0, 256, ("model.layers.2.attn",))], dsv4_config(compress_ratios=[4]), "no entry 2"),
        ([EngineGroup(0, 64, ("model.layers.0.attn.swa_cache",))], dsv4_config(sliding_window=None), "sliding_window"),
        (
            [EngineGroup(0, 64, ("model.layers.2.attn", "model.layers.2.attn.swa_cache"))],
            dsv4_config(),
            "mixes forms or windows",
        ),
        (
            [
                EngineGroup(
                    0, 4, ("model.layers.2.attn.compressor.state_cache", "model.layers.3.attn.compressor.state_cache")
                )
            ],
            dsv4_config(),
            "mixes forms or windows",
        ),
        # Not DSV4 (no compress_ratios): a cache module is never read as full or sliding attention.
        ([EngineGroup(0, 64, ("model.layers.0.attn.indexer.k_cache",))], {"sliding_window": 128}, "cannot classify"),
    ],
)
def test_unclassifiable_layers_are_refused_naming_the_layer(groups: list[EngineGroup], config: dict, says: str) -> None:
    with pytest.raises(VllmTierError, match=says) as exc:
        plan_groups(groups, config, 1)
    assert exc.value.code == "vllm_tier"


def resolved(**overrides: object) -> dict:
    """The DSV4 config as the engine resolved it (launch-time overrides applied), in the identity document."""
    hf = dsv4_config(**overrides)
    return {"model_config": {"hf_config": hf, "hf_text_config": hf}}


def test_namespace_changes_with_the_compressor_indexer_dtype_and_row_layout(tmp_path: Path) -> None:
    model = write_dsv4_checkpoint(tmp_path / "m")

    def namespace(layout: ChunkLayout = LAYOUT, **overrides: object) -> bytes:
        doc = resolved(**overrides)
        return derive_identity("deepseek-v4", model, dsv4_groups(), layout, ABI, doc, weights="xxh3_128:same").namespace

    seen: list[bytes] = []
    seen.append(namespace())
    assert namespace() == seen[0]  # the same checkpoint config elsewhere: the same namespace
    ratios = dsv4_config()["compress_ratios"]
    variants = [
        namespace(compress_ratios=[*ratios, 4]),  # e.g. an MTP layer's ratio: same groups, new compressor config
        namespace(index_topk=1024),
        namespace(index_n_heads=32),
        namespace(index_head_dim=64),
        namespace(sliding_window=256),
        namespace(kv_source_layer_ids=[0, 1, 2]),  # DeepSeek-V4.1's sharing keys: any config key counts
        namespace(index_source_layer_ids=[2]),
        namespace(dataclasses.replace(LAYOUT, kv_dtype="bfloat16")),
        namespace(dataclasses.replace(LAYOUT, chunk_bytes=2 * LAYOUT.chunk_bytes)),
        namespace(dataclasses.replace(LAYOUT, kv_cache_layout="NHD")),
    ]
    assert len(set(variants) | {seen[0]}) == len(variants) + 1
    key = derive_identity("deepseek-v4", model, dsv4_groups(), LAYOUT, ABI, resolved(), weights="w").version_key
    assert key.compression_version == key.indexer_version == IN_ENGINE_CONFIG
    assert key.engine_config == digest(resolved())
