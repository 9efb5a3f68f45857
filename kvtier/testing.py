"""Test doubles: an in-memory LowerTier for tests, benchmarks and demos.

Not the product's storage: nothing survives the process. Payloads are kept as bytes with their layout
digest and an xxh3-64 checksum, verified on every load, so corruption (see `corrupt`) is a `corrupt` miss,
as it is for the disk store.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import xxhash

from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest, MoreRequests, ObjectKey, every_request


class MemoryTier:
    """dict-backed LowerTier: has / load_into / store / pin / remove."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[ObjectKey, tuple[bytes, bytes, int]] = {}
        self.loads = 0

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        out = []
        with self._lock:
            objects = self._objects
            for key, digest in zip(keys, layout_digests):
                found = objects.get(key)
                out.append(
                    Reason.MISSING if found is None else Reason.OK if found[0] == digest else Reason.ABI_MISMATCH
                )
        return out

    def load_into(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> list[Reason]:
        requests = every_request(requests, more)
        out = []
        for req in requests:
            with self._lock:
                found = self._objects.get(req.key)
                self.loads += 1
            if found is None:
                out.append(Reason.MISSING)
                continue
            digest, payload, checksum = found
            if digest != req.layout_digest:
                out.append(Reason.ABI_MISMATCH)
            elif len(payload) != req.out.numel() or xxhash.xxh3_64_intdigest(payload) != checksum:
                out.append(Reason.CORRUPT)
            else:
                req.out.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
                out.append(Reason.OK)
        return out

    def store(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes) -> None:
        self.store_many([(key, payload, layout_digest)])

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        encoded = []
        for key, payload, layout_digest in items:
            data = payload.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            encoded.append((key, (layout_digest, data, xxhash.xxh3_64_intdigest(data))))
        with self._lock:
            self._objects.update(encoded)

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> int:
        with self._lock:
            return sum(k in self._objects for k in keys)

    def remove(self, keys: Sequence[ObjectKey]) -> int:
        with self._lock:
            return sum(self._objects.pop(k, None) is not None for k in keys)

    def corrupt(self, key: ObjectKey) -> None:
        """Flip one bit of a stored payload (its checksum is left as it was)."""
        with self._lock:
            digest, payload, checksum = self._objects[key]
            flipped = bytearray(payload)
            flipped[len(flipped) // 2] ^= 0x10
            self._objects[key] = (digest, bytes(flipped), checksum)

    def __len__(self) -> int:
        return len(self._objects)
