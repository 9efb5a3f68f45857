"""Shared helpers for the store tests: version keys, deterministic keys and payloads, real mounts."""

from __future__ import annotations

import os

import numpy as np
import torch
import xxhash

from kvtier.core import CacheForm, VersionKey
from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore, namespace_usage, ns_usage
from support.mounts import mounted  # noqa: F401  (re-exported for the store tests)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGEST = b"L" * 16
VK = VersionKey("ref-model", "w0", "abi-1", "comp-1", "idx-1", "fp8-packed")


def subprocess_env() -> dict[str, str]:
    """Environment for child Pythons: the checkout and these helpers importable, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, TESTS, env.get("PYTHONPATH", "")) if p)
    return env


def make_key(ns: bytes, tag: str, group: str = "c4", form: CacheForm = CacheForm.COMPRESSED) -> ObjectKey:
    return ObjectKey(ns, xxhash.xxh3_128_digest(tag.encode()), group, form)


def make_payload(tag: str, nbytes: int) -> torch.Tensor:
    seed = xxhash.xxh3_64_intdigest(tag.encode())
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def slot_like(nbytes: int, fill: int = 0xAA) -> torch.Tensor:
    """A load target at a 4096-aligned address, as a pool slot is: large payloads are read straight into it."""
    raw = torch.full((nbytes + 4096,), fill, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    return raw[start : start + nbytes]


def walked(s: DiskStore) -> dict[bytes, tuple[int, int]]:
    """Per namespace, records and record bytes as a walk over every index row finds them (the public scan)."""
    out: dict[bytes, tuple[int, int]] = {}
    after = None
    while page := s.iter_records(after, limit=64):
        for r in page:
            n, b = out.get(r.key.namespace, (0, 0))
            out[r.key.namespace] = (n + 1, b + (r.entry.record_len if r.entry is not None else 0))
        after = page[-1].key
    return out


def kept(s: DiskStore) -> dict[bytes, tuple[int, int]]:
    """Per namespace, records and record bytes as the store reports them (`namespace_usage`)."""
    return {ns: (u.records, u.bytes) for ns, u in namespace_usage(s.index).items()}


def current(s: DiskStore) -> bool:
    """Whether the store's namespace rows are trusted (`ns_usage.rows_current`)."""
    with s.index.read() as txn:
        return ns_usage.rows_current(s.index, txn)
