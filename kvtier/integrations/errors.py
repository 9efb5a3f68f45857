"""Typed errors of the engine plug-ins."""

from __future__ import annotations

from kvtier.core.errors import KvtierError


class VllmTierError(KvtierError):
    """The vLLM tier cannot be set up as configured (unknown checkpoint, unsupported KV group, bad option)."""

    code = "vllm_tier"


class UnrenderableConfig(KvtierError):
    """An engine's resolved configuration holds a value kvtier cannot render deterministically for its namespace."""

    code = "engine_config"
