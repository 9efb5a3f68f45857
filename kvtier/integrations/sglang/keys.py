"""SGLang's HiCache page keys, computed without SGLang, and kvtier's object keys for them.

What `kvtier prewarm` and `kvtier explain` need for an SGLang namespace. It follows SGLang 0.5.23:

- page hashes (`sglang/srt/mem_cache/utils.py` get_hash_str, the native `hash_binding.cpp`): page i of
  `page_size` tokens hashes to `sha256(prior digest + tokens)`, the prior digest being page i-1's (none for
  page 0, or the request's storage namespace seed where it has an `extra_key` / `cache_salt`); the tokens as
  uint32 little-endian, or, when one exceeds 2**32 - 1, the byte 0xff then every token as uint64; the key is
  the hex digest. HiCache stores whole pages only.
- kvtier's backend files page key k of a pool as `ObjectKey(namespace, xxh3_128(k), pool group, pool form)`
  (`integrations/sglang/backend.py`, `_key`).

The page size and the pools are read from the namespace itself (its version key and identity document).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from kvtier.core.errors import ConfigError
from kvtier.core.forms import CacheForm
from kvtier.integrations.sglang.pools import ANCHOR, PoolPlan

KERNEL_ABI_PREFIX = "sglang-"  # an SGLang backend's version key starts its kernel_abi so (identity.version_key)
_U32_MAX = 2**32 - 1
_PAGE = re.compile(r"(?:^|;)page=(\d+)t(?:;|$)")


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """SGLang's `storage_namespace_seed`: the prior hash of a request's first page (None for a plain request)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def page_hashes(
    tokens: Sequence[int], page_size: int, extra_key: str | None = None, cache_salt: str | None = None
) -> list[str]:
    """SGLang's storage page keys (hex) of a prompt: one per whole page of `page_size` tokens."""
    if page_size <= 0:
        raise ConfigError(f"page_size must be positive, got {page_size}", key="page_size")
    seed = namespace_seed(extra_key, cache_salt)
    prior = bytes.fromhex(seed) if seed else b""
    ids = [int(t) for t in tokens]
    out: list[str] = []
    for start in range(0, len(ids) - page_size + 1, page_size):
        page = ids[start : start + page_size]
        if max(page) > _U32_MAX:
            body = b"\xff" + struct.pack(f"<{len(page)}Q", *page)
        else:
            body = struct.pack(f"<{len(page)}I", *page)
        prior = hashlib.sha256(prior + body).digest()
        out.append(prior.hex())
    return out


def object_hash(page_key: str) -> bytes:
    """kvtier's 16-byte block hash of SGLang page key `page_key` (what the backend's `_key` stores under)."""
    return xxhash.xxh3_128_digest(page_key.encode())


def page_size_of(dtype_layout: str) -> int:
    """The page size an SGLang namespace's version key names (`page=<n>t` in its dtype_layout)."""
    m = _PAGE.search(dtype_layout)
    if m is None:
        raise ConfigError(
            "not an SGLang backend namespace layout (no page=<n>t): pick a namespace kvtier's SGLang backend "
            "registered",
            key="namespace",
        )
    return int(m.group(1))


def pool_plans(pools: Mapping[str, Any]) -> list[PoolPlan]:
    """The host pools an SGLang namespace's identity document lists (`identity["pools"]`), anchor pool first."""
    plans = []
    try:
        for name, p in pools.items():
            plans.append(
                PoolPlan(name, CacheForm(p["form"]), int(p["page_tokens"]), int(p["page_bytes"]), str(p["layout"]))
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the namespace's identity lists no usable pools ({exc})", key="namespace") from None
    if not plans:
        raise ConfigError("the namespace's identity lists no pools", key="namespace")
    return sorted(plans, key=lambda p: (p.name != ANCHOR, p.name))
