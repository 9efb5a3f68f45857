"""A vLLM tier's identity from what the engine resolved: its `VllmConfig`, its KV cache groups, its kernels.

vLLM hands a secondary tier only the offloading config (groups, a model name, a KV dtype); the configuration
the engine actually runs - the Hugging Face config after `--hf-overrides`, RoPE as resolved, dtype,
quantization, KV cache dtype - lives in the `VllmConfig` the offloading connector was built from. The tier
takes it from the connector that is constructing it (its caller's frame: `OffloadingConnectorScheduler`
holds `vllm_config` and `kv_cache_config` while it builds its tiers), checks that it is the configuration the
offloading config came from, and refuses to start where it cannot find one: config.json on disk is never
the identity. Code that builds a tier itself passes `vllm_config` (and `kv_cache_config`) explicitly.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import vllm
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.vllm import specs as vllm_specs
from kvtier.integrations.vllm.groups import EngineGroup, is_dsv4, layer_kind
from kvtier.integrations.vllm.identity import (
    ChunkLayout,
    EngineIdentity,
    derive_identity,
    resolved_hf_config,
    resolved_vllm_config,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

_MAX_FRAMES = 64


def engine_configs(
    config: OffloadingConfig, vllm_config: VllmConfig | None, kv_cache_config: KVCacheConfig | None
) -> tuple[VllmConfig, KVCacheConfig | None]:
    """The `VllmConfig` (and `KVCacheConfig`) `config` was built from: as given, or from the constructing connector."""
    if vllm_config is None:
        vllm_config, kv_cache_config = _from_caller(config)
    if vllm_config is None:
        raise VllmTierError(
            "cannot reach the engine's resolved configuration (VllmConfig): the kvtier tier must be created by "
            "vLLM's OffloadingConnector (kv_connector 'OffloadingConnector', spec 'TieringOffloadingSpec')"
        )
    _check_same_engine(config, vllm_config)
    return vllm_config, kv_cache_config


def _from_caller(config: OffloadingConfig) -> tuple[VllmConfig | None, KVCacheConfig | None]:
    """The nearest caller frame holding a `vllm_config` this offloading config was built from."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        found = frame.f_locals.get("vllm_config")
        if isinstance(found, VllmConfig) and _describes(config, found):
            kv = frame.f_locals.get("kv_cache_config")
            return found, kv if isinstance(kv, KVCacheConfig) else None
        frame = frame.f_back
    return None, None


def _describes(config: OffloadingConfig, vllm_config: VllmConfig) -> bool:
    transfer = vllm_config.kv_transfer_config
    return (
        vllm_config.model_config.model == config.model.name
        and transfer is not None
        and transfer.engine_id == config.engine_id
    )


def _check_same_engine(config: OffloadingConfig, vllm_config: VllmConfig) -> None:
    if not _describes(config, vllm_config):
        transfer = vllm_config.kv_transfer_config
        raise VllmTierError(
            f"the VllmConfig given (model {vllm_config.model_config.model!r}, engine id "
            f"{transfer.engine_id if transfer else None!r}) is not the one the offloading config was built from "
            f"(model {config.model.name!r}, engine id {config.engine_id!r})"
        )


def engine_identity(
    config: OffloadingConfig,
    vllm_config: VllmConfig,
    chunk_bytes: int,
    model_dir: str | None,
    weights_digest: str | None,
    attention_backend: str | None,
    kv_cache_config: KVCacheConfig | None = None,
) -> tuple[EngineIdentity, dict[str, Any]]:
    """Namespace, group plans and the identity document of one engine, from what it resolved.

    With the engine's `kv_cache_config` each group carries its layers' cache specs and is classified by them
    (specs.py); without one, by the checkpoint's config as resolved (groups.layer_kind)."""
    if vllm_config.weight_transfer_config is not None:
        raise VllmTierError(
            "this engine accepts weight updates while it runs (weight_transfer_config): its KV would outlive the "
            "weights the namespace names; run it without the kvtier tier"
        )
    resolved = resolved_vllm_config(vllm_config)
    model = vllm_config.model_config
    ckpt = Path(model_dir or model.model_weights or model.model)
    groups = (
        vllm_specs.engine_groups(config, kv_cache_config)
        if kv_cache_config is not None
        else [EngineGroup(g.group_id, g.tokens_per_block, tuple(g.layer_names)) for g in config.groups]
    )
    p = config.parallel
    parallel = (
        "agnostic"
        if p.is_parallelism_agnostic
        else f"world{p.world_size}.tp{p.tp_size}.pp{p.pp_size}.pcp{p.pcp_size}.dcp{p.dcp_size}"
    )
    layout = ChunkLayout(
        kv_dtype=config.model.dtype,
        kv_cache_layout=str(config.kv_cache_layout),
        chunk_bytes=chunk_bytes,
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        tokens_per_hash=config.cache.tokens_per_hash,
        parallel=f"{parallel};replicated={int(config.replicated_layout)};canonical={int(config.canonical_layout)}",
    )
    backend = _backend(vllm_config, resolved_hf_config(resolved), groups, attention_backend)
    kernel_abi = f"vllm {vllm.__version__};{current_platform.device_type};attn={backend}"
    identity = derive_identity(model.model, ckpt, groups, layout, kernel_abi, resolved, weights_digest)
    return identity, resolved


def _backend(vllm_config: VllmConfig, hf: Mapping[str, Any], groups: list[EngineGroup], configured: str | None) -> str:
    """The attention backend vLLM runs, as kvtier can read it in the scheduler process.

    For full and sliding-window models: vLLM's platform selector's answer (the engine's forced backend
    included). Where the selector does not answer (DeepSeek-V4's attention classes are chosen by the model
    from the forced backend and the device's compute capability), those inputs of vLLM's choice are the
    identity. A configured `attention_backend` must be a vLLM backend and agree with what vLLM runs."""
    forced = vllm_config.attention_config.backend
    selected = _selected(vllm_config, hf, groups, forced)
    if configured is not None:
        try:
            declared = AttentionBackendEnum[configured]
        except (KeyError, ValueError):  # vLLM's enum raises ValueError for an unknown name
            raise VllmTierError(
                f"attention_backend {configured!r} is no vLLM attention backend: use one of "
                f"{', '.join(b.name for b in AttentionBackendEnum)}"
            ) from None
        if selected is not None:
            runs = {name.split(":")[-1] for name in selected.split(",")}
        else:
            runs = {_class_name(forced)} if forced is not None else {_class_name(declared)}
        if _class_name(declared) not in runs:
            raise VllmTierError(
                f"attention_backend is {configured!r} in the kvtier tier config, but vLLM runs "
                f"{', '.join(sorted(runs))} here: remove the setting (kvtier reads the backend from vLLM) or correct it"
            )
    if selected is not None:
        return selected
    cap = current_platform.get_device_capability()
    device = f"sm{cap.major}{cap.minor}" if cap is not None else current_platform.device_type
    chosen = forced.name if forced is not None else configured or "auto"
    return f"{chosen}@{device}"


def _class_name(backend: AttentionBackendEnum) -> str:
    return backend.get_path().rsplit(".", 1)[-1]


def _selected(
    vllm_config: VllmConfig, hf: Mapping[str, Any], groups: list[EngineGroup], forced: AttentionBackendEnum | None
) -> str | None:
    """vLLM's platform selector's backend per attention kind (full / sliding), or None where it cannot answer.

    DeepSeek-V4-style models pick their MLA kernels per platform and cache module, past what the selector
    answers, so for them this is None; so it is for layers the config alone cannot sort into full or sliding
    attention (Mamba, linear attention): their groups are classified by their specs, and whether they can be
    served is decided there."""
    if is_dsv4(hf):
        return None
    model = vllm_config.model_config
    try:
        kinds = sorted({layer_kind(hf, n).window > 0 for g in groups for n in g.layer_names})
        heads = model.get_num_attention_heads(vllm_config.parallel_config)
        names = []
        for sliding in kinds:
            selector = AttentionSelectorConfig(
                head_size=model.get_head_size(),
                dtype=model.dtype,
                kv_cache_dtype=vllm_config.cache_config.cache_dtype,
                block_size=None,
                use_mla=model.use_mla,
                has_sliding_window=sliding,
            )
            path = current_platform.get_attn_backend_cls(forced, attn_selector_config=selector, num_heads=heads)
            names.append(f"{'swa' if sliding else 'full'}:{path.rsplit('.', 1)[-1]}")
    except Exception:  # vLLM's selectors differ by platform and version: then what the engine forces decides
        return None
    return ",".join(names)
