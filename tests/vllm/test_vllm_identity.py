"""The vLLM tier's identity and group mapping, in plain Python: runs in the project's suite (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.checkvector import usable_hit
from kvtier.core.forms import CacheForm
from kvtier.integrations.checkpoint import weights_digest
from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.vllm.groups import EngineGroup, GroupPlan, in_complete_window, plan_groups
from kvtier.integrations.vllm.identity import VLLM_EXCLUDED, ChunkLayout, derive_identity
from kvtier.store import DiskStore

GEMMA2 = {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}
GROUPS = [
    EngineGroup(0, 32, ("model.layers.0.self_attn.attn",)),
    EngineGroup(1, 32, ("model.layers.1.self_attn.attn",)),
]
LAYOUT = ChunkLayout("bfloat16", "NHD", 8192, 8192, 1, 32, "world1.tp1.pp1.pcp1.dcp1;replicated=0;canonical=0")
ABI = "vllm 0.32.0;cpu;attn=full:CPUAttentionBackend,swa:CPUAttentionBackend"


def checkpoint(path: Path, config: dict, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_groups_map_to_forms_by_their_layers_window() -> None:
    plans = plan_groups(GROUPS, GEMMA2, blocks_per_chunk=1)
    assert plans[0] == GroupPlan(0, "vllm.g0.swa64", CacheForm.SWA, 32, 64, plans[0].layers_digest)
    assert plans[1].name == "vllm.g1.full" and plans[1].form is CacheForm.COMPRESSED and plans[1].window_chunks == 0
    assert plans[0].window_chunks == 2
    assert plan_groups(GROUPS, GEMMA2, blocks_per_chunk=2)[0].window_chunks == 1  # one 64-token chunk


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        ({"sliding_window": 4096}, (4096, 4096)),  # Mistral-style: every layer windowed
        ({"sliding_window": 4096, "use_sliding_window": False}, (0, 0)),  # Qwen2-style switch
        ({}, (0, 0)),  # Llama
        ({"text_config": GEMMA2}, (64, 0)),  # multimodal configs nest the language model's
    ],
)
def test_configs_without_layer_types(config: dict, windows: tuple[int, int]) -> None:
    plans = plan_groups(GROUPS, config, 1)
    assert (plans[0].window_tokens, plans[1].window_tokens) == windows


@pytest.mark.parametrize(
    ("groups", "config", "says"),
    [
        ([EngineGroup(0, 32, ("model.layers.0.attn", "model.layers.1.attn"))], GEMMA2, "mixes sliding windows"),
        (
            [EngineGroup(0, 32, ("model.layers.0.mixer",))],
            {"layer_types": ["linear_attention"]},
            "full and sliding-window attention only",
        ),
        ([EngineGroup(0, 32, ("model.layers.5.attn",))], GEMMA2, "beyond config.json's layer_types"),
        ([EngineGroup(0, 32, ("decoder.attn",))], GEMMA2, "no 'layers.<n>' index"),
        ([EngineGroup(0, 32, ())], GEMMA2, "names no layers"),
    ],
)
def test_unservable_groups_are_refused_with_a_typed_error(groups: list[EngineGroup], config: dict, says: str) -> None:
    with pytest.raises(VllmTierError, match=says) as exc:
        plan_groups(groups, config, 1)
    assert exc.value.code == "vllm_tier"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.integers(1, 4))
def test_window_rule_matches_the_core_hit_rule(stored: list[bool], window_chunks: int) -> None:
    """A stored SWA chunk is a hit iff some boundary within its window is a usable hit by kvtier.core's rule."""
    t = 32
    plan = GroupPlan(0, "vllm.g0.swa", CacheForm.SWA, t, window_chunks * t, "x")
    n_state = np.array([0, window_chunks])
    m = len(stored)
    for j in range(m):
        if not stored[j]:
            continue
        got = in_complete_window((j + 1) * t, plan, lambda end: end // t <= m and stored[end // t - 1])
        want = any(
            usable_hit(np.array([[True] * k, stored[:k]]), n_state) == k
            for k in range(j + 1, min(m, j + window_chunks) + 1)
        )
        assert got == want, (j, stored, window_chunks)


def test_weights_digest_follows_the_bytes_not_the_name(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weights = rng.bytes(1 << 20)
    model = checkpoint(tmp_path / "m", GEMMA2, weights)
    before = weights_digest(model)
    (model / "tokenizer.json").write_text("{}")  # not part of what the model computes
    assert weights_digest(model) == before
    flipped = bytearray(weights)
    flipped[12345] ^= 1
    stat = (model / "model.safetensors").stat()
    (model / "model.safetensors").write_bytes(bytes(flipped))
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same name, size and mtime
    assert weights_digest(model) != before
    (model / "model.safetensors").unlink()
    with pytest.raises(VllmTierError, match="no weight files"):
        weights_digest(model)


def resolved(hf: dict, **model_fields: object) -> dict:
    """A resolved engine configuration document as `resolved_vllm_config` renders one (the parts read here)."""
    return {"model_config": {"hf_config": hf, "hf_text_config": hf, "dtype": "bfloat16", **model_fields}}


def test_namespace_changes_with_every_identity_field_and_registers_in_a_store(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m", GEMMA2, b"w" * 4096)
    doc = resolved(GEMMA2)
    base = derive_identity(str(model), model, GROUPS, LAYOUT, ABI, doc)
    assert derive_identity(str(model), model, GROUPS, LAYOUT, ABI, resolved(dict(GEMMA2))).namespace == base.namespace
    variants = [
        derive_identity(str(model), model, GROUPS, LAYOUT, ABI.replace("0.32.0", "0.33.0"), doc),
        derive_identity(str(model), model, GROUPS, LAYOUT, ABI, doc, weights="xxh3_128:other"),
        derive_identity(str(model), model, GROUPS, dataclasses.replace(LAYOUT, kv_dtype="float16"), ABI, doc),
        derive_identity(str(model), model, GROUPS, dataclasses.replace(LAYOUT, blocks_per_chunk=2), ABI, doc),
        derive_identity(str(model), model, GROUPS[::-1][:1], LAYOUT, ABI, doc),
        derive_identity("other-name", model, GROUPS, LAYOUT, ABI, doc),
        # What the engine resolved at launch, not what config.json says: an override, a dtype, any new field.
        derive_identity(str(model), model, GROUPS, LAYOUT, ABI, resolved({**GEMMA2, "rope_theta": 40000.0})),
        derive_identity(str(model), model, GROUPS, LAYOUT, ABI, resolved(GEMMA2, dtype="float32")),
        derive_identity(str(model), model, GROUPS, LAYOUT, ABI, resolved(GEMMA2, a_future_field=1)),
    ]
    assert len({v.namespace for v in variants} | {base.namespace}) == len(variants) + 1
    assert base.layout_digests[0] != base.layout_digests[1]
    with DiskStore(str(tmp_path / "store"), writer=True) as store:
        assert store.register_namespace(base.version_key, identity=doc) == base.namespace
        assert store.namespaces()[base.namespace].identity == doc
    with pytest.raises(VllmTierError, match="not a local checkpoint directory"):
        derive_identity("org/model", tmp_path / "missing", GROUPS, LAYOUT, ABI, doc)


def test_groups_are_classified_by_the_resolved_config_not_the_checkpoint(tmp_path: Path) -> None:
    """config.json says Gemma2 (layer 0 sliding); the engine resolved every layer full: kvtier follows the engine."""
    model = checkpoint(tmp_path / "m", GEMMA2, b"w" * 4096)
    launched = {**GEMMA2, "layer_types": ["full_attention", "full_attention"]}
    plans = derive_identity(str(model), model, GROUPS, LAYOUT, ABI, resolved(launched)).plans
    assert plans[0].form is CacheForm.COMPRESSED and plans[0].window_tokens == 0


def test_the_docs_list_exactly_the_fields_left_out_of_the_identity() -> None:
    """docs/vllm.md's table of exclusions is the code's: a field left out silently would be a hidden claim."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    section = text.split("### Identity, field by field", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {}
    for row in rows:
        paths, why = row.strip("| ").rsplit(" | ", 1)
        for path in re.findall(r"`([^`]+)`", paths):
            documented[path] = why
    assert documented == VLLM_EXCLUDED
