"""kvtier as SGLang's HiCache storage backend. SGLang's backend factory imports this package (`module_path`
`kvtier.integrations.sglang`, `class_name` `KvtierHiCacheStorage`); the class is fetched from `backend` only then,
so the plain-Python modules beside it (`identity`, `pools`, `writer`) import without SGLang."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KvtierHiCacheStorage":
        from kvtier.integrations.sglang.backend import KvtierHiCacheStorage

        return KvtierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
