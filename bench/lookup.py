"""Lookup + validation time of kvtier.gpu.CacheManager vs a bare dict lookup of the same block hashes.

Prints one JSON object: {"profile", "cases": [{"tokens", "mix", "lookup_ms", "bare_ms", "ratio",
"hash_ms"}, ...]} for the deepseek-v4-flash profile at 4K, 64K and 1M tokens.

* reuse: every history object of the prefix is resident, the final boundary is a checkpoint whose
  state objects are resident: the whole prefix is REUSE.
* mixed: the history pool holds 90 % of the prefix, so writing it evicted the oldest ~10 % of blocks
  (written back to an in-memory lower tier first: RECOVER); the final checkpoint's SWA object was
  evicted and is in no tier, so the coordinator probes the lower tier at the boundaries below and
  the hit falls back to the previous checkpoint (RECOMPUTE for the last blocks).

The lookup takes the chained block hashes (engines compute them once per request, as tokens
arrive); `hash_ms` is hashing the same prefix, measured separately. Pools are memfd-backed and only
metadata is written, so resident memory stays small whatever the virtual pool size. Pinned to one
core; medians over repeated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from kvtier.core import CacheForm, GroupKind, block_hashes, load_profile
from kvtier.core.layout import slot_stride
from kvtier.core.profile import ModelProfile
from kvtier.core.tier import ObjectKey
from kvtier.gpu import CacheManager
from kvtier.testing import MemoryTier

CHECKPOINT_EVERY = 4  # blocks between state checkpoints (vLLM-style retention interval, 1,024 tokens)
STATE_CHECKPOINTS = 8  # state checkpoints the state pools hold


def _budgets(profile: ModelProfile, history_blocks: int) -> dict[CacheForm, int]:
    h = profile.hash_block_tokens
    out: dict[CacheForm, int] = {}
    for g in profile.groups:
        per = slot_stride(g.object_bytes(h))
        n = history_blocks if g.kind is GroupKind.HISTORY else STATE_CHECKPOINTS
        out[g.form] = out.get(g.form, 0) + per * n
    return out


def _write(m: CacheManager, profile: ModelProfile, hashes: list[bytes], blocks: range) -> None:
    """Write (metadata only: reserve, seal whole) every history object and the state at checkpoints."""
    for b in blocks:
        checkpoint = (b + 1) % CHECKPOINT_EVERY == 0 or b == len(hashes) - 1
        for g in profile.groups:
            if g.kind is GroupKind.STATE and not checkpoint:
                continue
            handle = m.begin_write(
                ObjectKey(m.namespace, hashes[b], g.name, g.form), layout_digest=m.layout_digest(g.name)
            )
            if handle is not None:
                m.seal(handle, written_bytes=handle.nbytes)


def _setup(profile: ModelProfile, hashes: list[bytes], mix: str) -> CacheManager:
    n = len(hashes)
    tier = MemoryTier()
    if mix == "reuse":
        m = CacheManager(profile, budgets_bytes=_budgets(profile, n), lower=tier)
        _write(m, profile, hashes, range(n))
        return m
    resident = max(1, (n * 9) // 10)
    m = CacheManager(profile, budgets_bytes=_budgets(profile, resident), lower=tier)
    _write(m, profile, hashes, range(n - resident))
    m.persist()  # write-back of the blocks that are about to be evicted
    _write(m, profile, hashes, range(n - resident, n))
    m.evict([ObjectKey(m.namespace, hashes[-1], "swa", CacheForm.SWA)])
    return m


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(token_counts: list[int], repeat: int) -> dict:
    profile = load_profile("deepseek-v4-flash")
    h = profile.hash_block_tokens
    cases = []
    for tokens in token_counts:
        rng = np.random.default_rng(tokens)
        prompt = rng.integers(0, 129_280, tokens, dtype=np.int64)
        hash_ms = _median_ms(lambda p=prompt: block_hashes(profile.namespace, p, h), max(5, repeat // 10))
        hashes = block_hashes(profile.namespace, prompt, h)
        bare = {x: i for i, x in enumerate(hashes)}
        for mix in ("reuse", "mixed"):
            m = _setup(profile, hashes, mix)
            first = m.lookup(hashes)
            expect = len(hashes) if mix == "reuse" else len(hashes) - CHECKPOINT_EVERY
            if first.check_vector.hit_blocks != expect:
                raise SystemExit(
                    f"bench setup is wrong: {mix} hit {first.check_vector.hit_blocks} blocks, expected {expect}"
                )
            m.release(first)
            lookup_times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                result = m.lookup(hashes)
                lookup_times.append(time.perf_counter() - t0)
                m.release(result)
            lookup_ms = statistics.median(lookup_times) * 1e3
            bare_ms = _median_ms(lambda b=bare, hs=hashes: list(map(b.get, hs)), repeat)
            cases.append(
                {
                    "tokens": tokens,
                    "mix": mix,
                    "lookup_ms": round(lookup_ms, 4),
                    "bare_ms": round(bare_ms, 4),
                    "ratio": round(lookup_ms / bare_ms, 2),
                    "hash_ms": round(hash_ms, 3),
                }
            )
            m.close()
            del m
    return {"profile": profile.name, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 65536, 1 << 20])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    print(json.dumps(run(args.tokens, args.repeat)))


if __name__ == "__main__":
    main()
