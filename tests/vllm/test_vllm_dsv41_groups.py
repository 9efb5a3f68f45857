"""vLLM's KV cache groups classified by their cache specs (kvtier.integrations.vllm.specs + groups).

The specs are vLLM's own: built by its DeepSeek-V4 and V4.1 cache classes (support/vllm_dsv4.py,
support/vllm_dsv41.py), grouped by `get_kv_cache_groups`, laid out by `get_kv_cache_config_from_groups`, the
scheduler's copy made by `generate_scheduler_kv_cache_config` and the offloading config by vLLM's own
`build_offloading_config`: the same objects the OffloadingConnector holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from support.vllm_harness import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.config import KVTransferConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
)

from kvtier.core.forms import CacheForm  # noqa: E402
from kvtier.integrations.errors import VllmTierError  # noqa: E402
from kvtier.integrations.vllm.groups import EngineGroup, LayerSpec, plan_groups  # noqa: E402
from kvtier.integrations.vllm.specs import engine_groups, layer_spec  # noqa: E402
from support.vllm_dsv4 import dsv4_layer_specs  # noqa: E402
from support.vllm_dsv4_model import dsv4_config, write_dsv4_checkpoint  # noqa: E402
from support.vllm_dsv41 import dsv41_layer_specs, resolved_as_on_amx_hosts  # noqa: E402, F401
from support.vllm_dsv41_model import RATIOS, write_dsv41_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("resolved_as_on_amx_hosts")  # (support/vllm_dsv41.py says why)


def vllm_configs(model_dir: Path, layer_specs) -> tuple:
    """(offloading config, worker-side KVCacheConfig, scheduler-side KVCacheConfig) as vLLM builds them."""
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", engine_id="groups")
    config, specs = layer_specs(model_dir, kv_transfer_config=transfer)
    config.cache_config.enable_prefix_caching = True
    with set_current_vllm_config(config):
        worker = get_kv_cache_config_from_groups(config, get_kv_cache_groups(config, specs), 8 << 30)
        scheduler = generate_scheduler_kv_cache_config([worker])
        return build_offloading_config(config, scheduler), worker, scheduler


def summary(plans: dict) -> dict:
    return {g: (p.name, p.form, p.tokens_per_chunk, p.window_tokens) for g, p in plans.items()}


def test_v4_groups_by_spec_are_the_v4_groups_by_config(tmp_path: Path) -> None:
    """DeepSeek-V4 keeps its forms, windows, chunk spans and group names whichever way it is classified."""
    offloading, worker, scheduler = vllm_configs(write_dsv4_checkpoint(tmp_path / "v4"), dsv4_layer_specs)
    by_config = plan_groups(
        [EngineGroup(g.group_id, g.tokens_per_block, g.layer_names) for g in offloading.groups], dsv4_config(), 1
    )
    for kv in (worker, scheduler):
        by_spec = plan_groups(engine_groups(offloading, kv), {}, 1)
        assert summary(by_spec) == summary(by_config)
    forms = sorted((p.form.value, p.window_tokens) for p in by_config.values())
    assert forms == [("compressed", 0), ("swa", 128), ("swa", 128), ("tail", 8), ("tail", 128)]


def test_v41_groups_by_spec_from_the_worker_and_the_scheduler_config(tmp_path: Path) -> None:
    model = write_dsv41_checkpoint(tmp_path / "v41")
    offloading, worker, scheduler = vllm_configs(model, dsv41_layer_specs)
    from_worker = plan_groups(engine_groups(offloading, worker), {}, 1)
    from_scheduler = plan_groups(engine_groups(offloading, scheduler), {}, 1)
    assert summary(from_worker) == summary(from_scheduler)
    assert sorted((p.form.value, p.tokens_per_chunk, p.window_tokens) for p in from_worker.values()) == [
        ("compressed", 256, 0),
        ("swa", 32, 128),
        ("swa", 32, 128),
    ]
    # The worker's config keeps each layer's spec: the history group's layout names all four caches it packs.
    (history,) = [p for p in from_worker.values() if p.form is CacheForm.COMPRESSED]
    assert sorted(k.split(":")[1] for k in history.kinds.split("+")) == ["r1", "r1", "r2", "r2"]
    # The ring group is vLLM's but not offloaded (not keyed by prefix): the tier never receives it.
    rings = [
        i for i, g in enumerate(worker.kv_cache_groups) if isinstance(g.kv_cache_spec.first_spec, CircularBufferSpec)
    ]
    assert len(rings) == 1 and rings[0] not in from_worker
    # Without specs (config.json only), kvtier still refuses V4.1's ratios: the spec path is what serves V4.1.
    with pytest.raises(VllmTierError, match="compress ratio 2"):
        groups = [EngineGroup(g.group_id, g.tokens_per_block, g.layer_names) for g in offloading.groups]
        plan_groups(groups, {"compress_ratios": RATIOS, "sliding_window": 128}, 1)


def test_a_group_vllm_does_not_key_by_prefix_is_refused_naming_its_layer() -> None:
    ring = layer_spec(CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=1024, dtype=torch.float32))
    group = EngineGroup(3, 8, ("model.layers.2.attn.compressor.state_cache",), (ring,))
    with pytest.raises(VllmTierError, match=r"'model\.layers\.2\.attn\.compressor\.state_cache'.*CircularBufferSpec"):
        plan_groups([group], {}, 1)
    # A ring vLLM did key by prefix would still name no token positions: refused too.
    keyed = dataclasses.replace(group, layer_specs=(dataclasses.replace(ring, prefix_cacheable=True),))
    with pytest.raises(VllmTierError, match="does not key by token prefix"):
        plan_groups([keyed], {}, 1)


@pytest.mark.parametrize(
    "spec",
    [
        MambaSpec(block_size=256, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align"),
        ChunkedLocalAttentionSpec(
            block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, attention_chunk_size=128
        ),
    ],
)
def test_a_spec_kvtier_has_no_rule_for_is_served_as_all_blocks_history(spec) -> None:
    """Every block up to a hit must be stored: at worst fewer hits than a rule would give, never a broken one."""
    (plan,) = plan_groups(
        [EngineGroup(0, spec.block_size, ("model.layers.0.mixer",), (layer_spec(spec),))], {}, 1
    ).values()
    assert (plan.form, plan.window_tokens, plan.window_chunks) == (CacheForm.COMPRESSED, 0, 0)
    assert plan.kinds.startswith(f"all-blocks:{type(spec).__name__}")


def test_full_attention_with_a_sliding_window_field_keeps_every_block() -> None:
    """vLLM's FullAttentionSpec with `sliding_window` (hybrid allocator off) allocates every block: history."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    (plan,) = plan_groups([EngineGroup(0, 16, ("model.layers.0.self_attn.attn",), (layer_spec(spec),))], {}, 1).values()
    assert (plan.form, plan.window_tokens, plan.name) == (CacheForm.COMPRESSED, 0, "vllm.g0.full")


def test_mixed_or_malformed_groups_are_refused() -> None:
    full = LayerSpec("attention", "FullAttentionSpec", 32)
    swa = LayerSpec("sliding_window", "SlidingWindowSpec", 32, sliding_window=128)
    names = ("model.layers.0.attn", "model.layers.1.attn")
    with pytest.raises(VllmTierError, match="KV group 0 mixes forms or windows"):
        plan_groups([EngineGroup(0, 32, names, (full, swa))], {}, 1)
    with pytest.raises(VllmTierError, match="window 0"):
        plan_groups([EngineGroup(0, 32, names[:1], (dataclasses.replace(swa, sliding_window=0),))], {}, 1)
    with pytest.raises(VllmTierError, match="3 specs for 2 layers"):
        plan_groups([EngineGroup(0, 32, names, (full, full, full))], {}, 1)
    with pytest.raises(VllmTierError, match="KV group 1 has 0 specs"):  # some groups with specs, one without
        plan_groups([EngineGroup(0, 32, names[:1], (full,)), EngineGroup(1, 32, names[1:])], {}, 1)


def test_engine_groups_refuses_a_kv_cache_config_of_another_engine(tmp_path: Path) -> None:
    offloading, worker, _ = vllm_configs(write_dsv41_checkpoint(tmp_path / "v41"), dsv41_layer_specs)
    other, _, _ = vllm_configs(write_dsv4_checkpoint(tmp_path / "v4"), dsv4_layer_specs)
    with pytest.raises(VllmTierError, match="pass the KVCacheConfig the connector was built with"):
        engine_groups(other, worker)
    fewer = dataclasses.replace(worker, kv_cache_groups=worker.kv_cache_groups[:1])
    with pytest.raises(VllmTierError, match="has 1 groups"):
        engine_groups(offloading, fewer)
