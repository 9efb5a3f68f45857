"""Chained 128-bit block hashes (xxh3_128), seeded by the namespace; stable across processes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_BYTES = 16
_ROOT_TAG = b"kvtier-block-root-v1"


def root_hash(namespace: bytes) -> bytes:
    """h_{-1}: the chain's seed, derived from the namespace so no two namespaces share a hash."""
    return xxhash.xxh3_128_digest(_ROOT_TAG + namespace)


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as little-endian uint32 bytes (the hashed encoding); accepts lists, numpy and torch."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("tokens must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def block_hashes(namespace: bytes, tokens: Sequence[int] | np.ndarray, hash_block_tokens: int) -> list[bytes]:
    """h_i = xxh3_128(h_{i-1} || tokens of block i) for every whole block; a partial tail is not hashed."""
    data = token_bytes(tokens)
    step = hash_block_tokens * 4
    prev = root_hash(namespace)
    out: list[bytes] = []
    digest = xxhash.xxh3_128_digest
    for start in range(0, len(data) - step + 1, step):
        prev = digest(prev + data[start : start + step])
        out.append(prev)
    return out


class BlockHasher:
    """Incremental hashing for engines that see tokens as they arrive."""

    __slots__ = ("_pending", "_prev", "_step", "hashes")

    def __init__(self, namespace: bytes, hash_block_tokens: int) -> None:
        self._prev = root_hash(namespace)
        self._pending = b""
        self._step = hash_block_tokens * 4
        self.hashes: list[bytes] = []

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Add tokens; returns the hashes of the blocks they completed."""
        data = self._pending + token_bytes(tokens)
        new: list[bytes] = []
        step = self._step
        usable = len(data) - len(data) % step
        for start in range(0, usable, step):
            self._prev = xxhash.xxh3_128_digest(self._prev + data[start : start + step])
            new.append(self._prev)
        self._pending = data[usable:]
        self.hashes.extend(new)
        return new
