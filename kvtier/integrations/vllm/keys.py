"""vLLM's own prefix keys, computed without vLLM: its block hashes, the offloading chunk keys, kvtier's object keys.

This is what `kvtier prewarm` and `kvtier explain` need for a vLLM namespace (they run in kvtier's venv, where
vLLM may be absent). It follows vLLM 0.32 step by step:

- block hashes (`vllm/v1/core/kv_cache_utils.py`): `h_i = H((h_{i-1}, tuple(tokens of block i), extra_keys))`
  over whole blocks of `tokens_per_hash` tokens, `h_{-1} = NONE_HASH = H(seed)`; `H` is
  `prefix_caching_hash_algo` (`vllm/utils/hashing.py`: pickle or canonical CBOR, then SHA-256 or xxh3-128);
  the seed is PYTHONHASHSEED where the engine had it set, else "vllm-none-hash" (the cryptographic algorithms;
  the xxhash ones draw a random seed per process then, so nothing can be recomputed without PYTHONHASHSEED);
- the offloading connector's chunk of group g ending at token e is keyed by the block hash ending at e
  (`update_offload_keys`: every `tokens_per_chunk / tokens_per_hash`-th hash);
- kvtier's vLLM tier files that chunk as `ObjectKey(namespace, xxh3_128(block hash), group name, form)`
  (`integrations/vllm/tier.py`, `_object_key`).

Everything the namespace fixes (hash block, chunk size, groups and their windows) is read from the namespace's
own version key (`layout`), so only what the namespace does not carry comes from the operator: the hash
algorithm and seed, and a request's cache salt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import re
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvtier.core.errors import ConfigError
from kvtier.core.forms import CacheForm, GroupKind

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for the cryptographic algorithms when PYTHONHASHSEED is unset
KERNEL_ABI_PREFIX = "vllm "  # a vLLM tier's version key starts its kernel_abi so (integrations/vllm/resolve.py)

_GROUP = re.compile(r"^(vllm\.g(\d+)\.[^:]+):([a-z_]+):(\d+)t(?::.*)?:layers-[0-9a-f]+$")
_WINDOW = re.compile(r"(\d+)$")


def _cbor(value: Any) -> bytes:
    try:
        import cbor2
    except ImportError:
        raise ConfigError(
            "hash_algo sha256_cbor / xxhash_cbor needs the cbor2 package: pip install cbor2", key="hash_algo"
        ) from None
    return cbor2.dumps(value, canonical=True)


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's `get_hash_fn_by_name(algo)`, reimplemented."""
    if algo == "sha256":
        return lambda v: hashlib.sha256(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        return lambda v: hashlib.sha256(_cbor(v)).digest()
    if algo == "xxhash":
        return lambda v: xxhash.xxh3_128_digest(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))
    if algo == "xxhash_cbor":
        return lambda v: xxhash.xxh3_128_digest(_cbor(v))
    raise ConfigError(f"unknown prefix caching hash {algo!r}: one of {', '.join(HASH_ALGOS)}", key="hash_algo")


def none_hash_seed(algo: str, seed: str | None) -> str:
    """The seed vLLM derived NONE_HASH from: the engine's PYTHONHASHSEED (`seed`), else vLLM's fixed default."""
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        raise ConfigError(
            f"with hash_algo {algo} vLLM seeds its hashes from PYTHONHASHSEED, or at random without it: set "
            "hash_seed to the engine's PYTHONHASHSEED (an engine without one has keys no other process can compute)",
            key="hash_seed",
        )
    return DEFAULT_SEED


def block_hashes(
    tokens: Sequence[int], tokens_per_hash: int, algo: str, seed: str | None = None, cache_salt: str | None = None
) -> list[bytes]:
    """vLLM's `request.block_hashes` of a prompt: one per whole block of `tokens_per_hash` tokens."""
    fn = hash_function(algo)
    parent = fn(none_hash_seed(algo, seed))
    ids = [int(t) for t in tokens]  # vLLM hashes Python ints: a numpy scalar pickles differently
    out: list[bytes] = []
    for start in range(0, len(ids) - tokens_per_hash + 1, tokens_per_hash):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = fn((parent, tuple(ids[start : start + tokens_per_hash]), extra))
        out.append(parent)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class VllmGroup:
    """One vLLM KV cache group as kvtier's tier filed it: object group name, form, chunk span, state window."""

    group_id: int
    name: str
    form: CacheForm
    tokens_per_chunk: int
    window_tokens: int  # 0: history (every chunk from 0); else the state window, tokens
    describe: str  # the group's GroupPlan.describe(), as the layout lists it


@dataclasses.dataclass(frozen=True, slots=True)
class VllmLayout:
    """What a vLLM namespace's version key fixes about its keys (its `dtype_layout`, ChunkLayout.describe)."""

    tokens_per_hash: int
    blocks_per_chunk: int
    chunk_bytes: int  # every record's payload: vLLM's CPU-tier row for one chunk
    groups: tuple[VllmGroup, ...]


def layout_digest(kernel_abi: str, dtype_layout: str, group: VllmGroup) -> bytes:
    """The layout digest the tier stores `group`'s records with (integrations/vllm/identity.derive_identity)."""
    text = f"{kernel_abi}|{dtype_layout}|{group.describe}"
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvtier-vllm-lay1").digest()


def parse_layout(dtype_layout: str) -> VllmLayout:
    """The hash block, chunk size and groups from a vLLM namespace's `dtype_layout`; ConfigError if it is not one."""
    fields = dict(p.split("=", 1) for p in dtype_layout.split(";") if "=" in p)
    try:
        tokens_per_hash = int(fields["hash"].removesuffix("t"))
        chunk_bytes = int(fields["chunk"].split("/")[0].removesuffix("B"))
        blocks_per_chunk = int(fields["chunk"].split("/")[1].removesuffix("blk"))
        groups = []
        for text in fields["groups"].split(","):
            m = _GROUP.match(text)
            if m is None:
                raise ValueError(f"group {text!r}")
            name, gid, form, tpc = m.group(1), int(m.group(2)), CacheForm(m.group(3)), int(m.group(4))
            # the tier names a state group after its window (groups.plan_groups): vllm.g1.swa64, vllm.g2.tail128
            w = _WINDOW.search(name.rsplit(".", 1)[-1]) if form.kind is GroupKind.STATE else None
            groups.append(VllmGroup(gid, name, form, tpc, int(w.group(1)) if w else 0, text))
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"not a vLLM tier namespace layout ({exc}): pick a namespace a kvtier vLLM tier registered",
            key="namespace",
        ) from None
    return VllmLayout(tokens_per_hash, blocks_per_chunk, chunk_bytes, tuple(groups))


def chunk_hashes(hashes: Sequence[bytes], layout: VllmLayout, group: VllmGroup) -> list[bytes]:
    """kvtier's 16-byte block hash of each whole chunk of `group`: xxh3-128 of vLLM's hash ending the chunk."""
    per_chunk = group.tokens_per_chunk // layout.tokens_per_hash
    return [xxhash.xxh3_128_digest(h) for h in hashes[per_chunk - 1 :: per_chunk]]
