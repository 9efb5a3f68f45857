"""An engine's resolved configuration as canonical data: what an engine namespace hashes. Plain Python.

Contract: `canonical(value, excluded)` renders a configuration object graph (dataclasses, pydantic
models, Hugging Face `PretrainedConfig`, mappings, sequences, enums, torch dtypes, paths, scalars) as
JSON data with every field kept except the dotted paths in `excluded`. The rule is exclusion, never
selection: a field an engine version adds changes the digest (a new namespace, so a miss) instead of
being ignored (a hit on bytes another configuration wrote). Each exclusion names why the field cannot
change a cached KV byte; docs/vllm.md and docs/sglang.md list them.

An object that cannot be rendered deterministically (a callable, a lock, anything whose only text is its
address) raises `UnrenderableConfig` naming its path: the caller refuses to start rather than hash
something that differs between two identical launches or, worse, hides a difference.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

from kvtier.integrations.errors import UnrenderableConfig

_MAX_DEPTH = 32
_HF_CONFIG_BASES = ("PreTrainedConfig", "PretrainedConfig")


def canonical(value: Any, excluded: Mapping[str, str] = {}, path: str = "") -> Any:
    """`value` as JSON data; dotted paths in `excluded` (path -> reason) are left out."""
    return _render(value, excluded, path, 0, set())


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _render(value: Any, excluded: Mapping[str, str], path: str, depth: int, seen: set[int]) -> Any:
    if depth > _MAX_DEPTH:
        raise UnrenderableConfig(f"configuration field '{path}' nests deeper than {_MAX_DEPTH}: cannot identify it")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # repr keeps every bit of a finite float; JSON has no NaN or infinity, so they become strings.
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return _render(value.value, excluded, path, depth + 1, seen)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "device"):
        return str(value).removeprefix("torch.")
    if id(value) in seen:
        raise UnrenderableConfig(f"configuration field '{path}' refers back to itself: cannot identify it")
    seen = seen | {id(value)}
    if isinstance(value, Mapping):
        return _fields({str(k): v for k, v in value.items()}, excluded, path, depth, seen)
    if isinstance(value, (list, tuple)):
        return [_render(v, excluded, f"{path}[{i}]", depth + 1, seen) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [_render(v, excluded, f"{path}[]", depth + 1, seen) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    fields = _declared(value)
    if fields is None:
        raise UnrenderableConfig(
            f"configuration field '{path}' holds a {type(value).__module__}.{type(value).__qualname__}, which kvtier "
            "cannot render deterministically: this engine version is not supported by this kvtier"
        )
    # Declared fields are not all of it: configs set derived attributes in __init__ / __post_init__ (a model
    # config's own keys, an architecture's derived sizes), so every public attribute is rendered too.
    attrs = {k: v for k, v in vars(value).items() if not k.startswith("_")} if hasattr(value, "__dict__") else {}
    return _fields({**attrs, **fields, "__class__": type(value).__name__}, excluded, path, depth, seen)


def _declared(value: Any) -> dict[str, Any] | None:
    """An object's declared configuration fields: a Hugging Face config's `to_dict()` (whatever module defines the
    model's config class), a dataclass's or a pydantic model's fields; None for anything else."""
    if any(c.__name__ in _HF_CONFIG_BASES and c.__module__.startswith("transformers") for c in type(value).__mro__):
        return dict(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    model_fields = getattr(type(value), "model_fields", None)  # pydantic models
    if isinstance(model_fields, Mapping):
        return {name: getattr(value, name) for name in model_fields}
    return None


def _fields(
    items: Mapping[str, Any], excluded: Mapping[str, str], path: str, depth: int, seen: set[int]
) -> dict[str, Any]:
    out = {}
    for name in sorted(items):
        sub = _join(path, name)
        if sub not in excluded:
            out[name] = _render(items[name], excluded, sub, depth + 1, seen)
    return out


def digest(doc: Any) -> str:
    """blake2b-16 of the canonical JSON text of `doc` (sorted keys, no spaces)."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "blake2b16:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
