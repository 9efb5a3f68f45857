"""kvtier under vLLM's CPU offloading. vLLM's tier factory imports this package (`"module_path":
"kvtier.integrations.vllm"`) and asks it for `KvtierSecondaryTier`; the class is fetched from `tier` only then,
so the plain-Python modules beside it (`identity`, `groups`, `specs`' callers) import without vLLM."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KvtierSecondaryTier":
        from kvtier.integrations.vllm.tier import KvtierSecondaryTier

        return KvtierSecondaryTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
