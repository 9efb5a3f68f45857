"""Shared set-up for the kvtier.gpu tests: a small profile, deterministic payloads, a fake clock."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from kvtier.core import CacheForm, GroupKind, ModelProfile, block_hashes, load_profile
from kvtier.core.layout import slot_stride
from kvtier.core.tier import ObjectKey
from kvtier.gpu import AdmissionConfig, CacheManager
from kvtier.testing import MemoryTier

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens


class FakeClock:
    """A monotonic clock the test moves by hand (lease TTLs without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def payload(profile: ModelProfile, group: str, block_hash: bytes, namespace: bytes) -> torch.Tensor:
    """The bytes a writer puts in (namespace, hash, group): distinct for every key, checkable on read."""
    n = profile.group(group).object_bytes(profile.hash_block_tokens)
    seed = hashlib.blake2b(namespace + block_hash + group.encode(), digest_size=64).digest()
    return torch.from_numpy(np.resize(np.frombuffer(seed, dtype=np.uint8), n).copy())


def budgets(profile: ModelProfile, blocks: int, state_blocks: int | None = None) -> dict[CacheForm, int]:
    """Byte budgets holding `blocks` history blocks and `state_blocks` state blocks per form."""
    h = profile.hash_block_tokens
    out: dict[CacheForm, int] = {}
    for g in profile.groups:
        n = blocks if g.kind is GroupKind.HISTORY else (state_blocks or blocks)
        out[g.form] = out.get(g.form, 0) + slot_stride(g.object_bytes(h)) * n
    return out


def make(
    blocks: int = 8,
    state_blocks: int | None = None,
    *,
    lower: bool = True,
    clock: FakeClock | None = None,
    profile: ModelProfile = PROFILE,
    ttl: float = 30.0,
    **admission: object,
) -> tuple[CacheManager, MemoryTier | None, FakeClock]:
    clock = clock or FakeClock()
    tier = MemoryTier() if lower else None
    m = CacheManager(
        profile,
        budgets_bytes=budgets(profile, blocks, state_blocks),
        lower=tier,
        admission=AdmissionConfig(**admission),  # type: ignore[arg-type]
        lease_ttl_s=ttl,
        clock=clock,
    )
    return m, tier, clock


def prompt(seed: int, n_blocks: int, shared: tuple[int, int] | None = None) -> np.ndarray:
    """Tokens of n_blocks hash blocks; `shared=(seed, k)` copies the first k blocks of another prompt."""
    toks = np.random.default_rng(seed).integers(0, 256, n_blocks * H)
    if shared is not None:
        toks[: shared[1] * H] = np.random.default_rng(shared[0]).integers(0, 256, n_blocks * H)[: shared[1] * H]
    return toks


def hashes_of(m: CacheManager, tokens: np.ndarray) -> list[bytes]:
    return block_hashes(m.namespace, tokens, H)


def key(m: CacheManager, block_hash: bytes, group: str) -> ObjectKey:
    return ObjectKey(m.namespace, block_hash, group, m.profile.group(group).form)


def write(m: CacheManager, hashes: list[bytes], blocks: range | list[int], *, state_at: set[int] | None = None) -> int:
    """Write history objects of `blocks` and state objects of the blocks in `state_at`; returns objects written."""
    n = 0
    for b in blocks:
        for g in m.profile.groups:
            if g.kind is GroupKind.STATE and (state_at is None or b not in state_at):
                continue
            n += m.write_block(
                key(m, hashes[b], g.name),
                payload(m.profile, g.name, hashes[b], m.namespace),
                layout_digest=m.layout_digest(g.name),
            )
    return n


def state_blocks_for(profile: ModelProfile, boundary: int) -> set[int]:
    """Blocks whose state objects a checkpoint at `boundary` needs (the widest state window)."""
    h = profile.hash_block_tokens
    widest = max(g.blocks_needed(h) for g in profile.groups if g.kind is GroupKind.STATE)
    return set(range(max(0, boundary - widest), boundary))
