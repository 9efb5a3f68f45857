"""kvtier under vLLM's offloading connector for DeepSeek-V4's five KV groups, as vLLM 0.32 forms them.

The groups, their block sizes and layer names come from vLLM's own DSV4 cache modules and grouping
(dsv4_vllm.py); keys are vLLM's `OffloadKey`s with the end-token positions vLLM records; lookups follow
the connector's scans (history groups: a prefix from chunk 0; sliding-window groups: from the end, a
whole window). Not covered here: vLLM's Scheduler itself driving the tier (see docs/vllm.md, Tests).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from support.vllm_harness import require_vllm

require_vllm()

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvtier.integrations.vllm import KvtierSecondaryTier  # noqa: E402
from support.daemon import DaemonProc  # noqa: E402
from support.vllm_dsv4 import dsv4_offloading_config  # noqa: E402
from support.vllm_dsv4_model import RATIOS, write_dsv4_checkpoint  # noqa: E402
from support.vllm_harness import flip_payload_byte, kvtier_audit  # noqa: E402

ROW = 8192  # bytes per offloaded chunk here (vLLM's packed DSV4 block is 1,002,240: see the bench)
TOKENS = 1024  # four 256-token history chunks
HISTORY, SWA_A, SWA_B, C4_STATE, C128_STATE = "history", "swa_a", "swa_b", "c4_state", "c128_state"


def block_hashes(seed: int, n: int, shared: int = 0, base_seed: int = 0) -> list[bytes]:
    """vLLM-style chained hashes of `n` 4-token hash blocks; the first `shared` equal those of `base_seed`."""
    out, h = [], b""
    for i in range(n):
        s = base_seed if i < shared else seed
        h = hashlib.sha256(h + s.to_bytes(4, "big") + i.to_bytes(4, "big")).digest()
        out.append(h)
    return out


class Request:
    """One prompt's keys per group, registered in a ReqContext the way vLLM's connector does."""

    def __init__(self, env: SimpleNamespace, hashes: list[bytes], name: str) -> None:
        self.ctx = ReqContext(name)
        self.keys: dict[int, list[bytes]] = {}
        for g in env.config.groups:
            per = g.tokens_per_block // 4
            self.keys[g.group_id] = []
            for end_hash in range(per - 1, len(hashes), per):
                key = make_offload_key(hashes[end_hash], g.group_id)
                self.keys[g.group_id].append(key)
                self.ctx.set_offload_key_position(key, (end_hash + 1) * 4)


def scan(tier: KvtierSecondaryTier, req: Request, group: int, window: int) -> int:
    """Tokens vLLM's connector would take from this group: a prefix (window 0) or the last whole window."""
    keys, t = req.keys[group], tier._plans[group].tokens_per_chunk
    if window == 0:
        n = 0
        while n < len(keys) and tier.lookup(keys[n], req.ctx) is LookupResult.HIT:
            n += 1
        return n * t
    run = 0
    for i in range(len(keys) - 1, -1, -1):
        run = run + 1 if tier.lookup(keys[i], req.ctx) is LookupResult.HIT else 0
        if run == window:
            return (i + window) * t
    return 0


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = write_dsv4_checkpoint(tmp_path_factory.mktemp("m") / "dsv4")
    config, block = dsv4_offloading_config(model, ROW)
    assert block == 1_002_240  # vLLM's packed DSV4 block
    return {"model": model, "config": config}


@pytest.fixture(params=["store_dir", "daemon"])
def env(request, groups: dict, tmp_path: Path):
    store = tmp_path / "store"
    daemon = None
    if request.param == "daemon":
        (tmp_path / "daemon").mkdir()
        daemon = DaemonProc(tmp_path / "daemon", store_root=store)
    primary = np.zeros((4096, ROW), dtype=np.uint8)
    tiers: list[KvtierSecondaryTier] = []

    def tier(model: Path = groups["model"]) -> KvtierSecondaryTier:
        config, _ = dsv4_offloading_config(model, ROW) if model != groups["model"] else (groups["config"], 0)
        where = {"daemon_socket": str(daemon.socket)} if daemon else {"store_dir": str(store)}
        t = KvtierSecondaryTier(
            SimpleNamespace(config=config),
            memoryview(primary),
            "KvtierSecondaryTier",
            attention_backend="FLASHMLA_SPARSE",
            **where,
        )
        tiers.append(t)
        return t

    config = groups["config"]
    yield SimpleNamespace(primary=primary, tier=tier, store=store, config=config, model=groups["model"], daemon=daemon)
    for t in tiers:
        t.shutdown()
    if daemon is not None:
        assert daemon.terminate() == 0


def roles(tier: KvtierSecondaryTier) -> dict[str, int]:
    """Group id per role, from the tier's own classification (vLLM's ids follow registration order)."""
    by = {}
    swa = sorted(g for g, p in tier._plans.items() if p.form.value == "swa")
    by[SWA_A], by[SWA_B] = swa
    for g, p in tier._plans.items():
        if p.form.value == "compressed":
            by[HISTORY] = g
        elif p.form.value == "tail":
            by[C4_STATE if p.window_tokens == 8 else C128_STATE] = g
    return by


_ids = iter(range(1 << 30))


def run_job(tier: KvtierSecondaryTier, keys: list[bytes], chunks: list[int], ctx: ReqContext, load: bool):
    job = TransferJob(next(_ids), keys, np.array(chunks, dtype=np.int32), load, ctx)
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    (result,) = [r for r in tier.get_finished_jobs() if r.job_id == job.job_id]
    return result


def store_request(env, tier, req: Request, dense: bool, skip: tuple[str, int] | None = None) -> dict[bytes, int]:
    """Store as vLLM keeps them: every history chunk; state chunks of the window at the prompt's end, or
    (dense retention) at every 256-token boundary; `skip`: (role, chunk index) never stored. Each chunk gets its
    own random row. Returns key -> row."""
    rng = np.random.default_rng(len(req.keys))
    rows: dict[bytes, int] = {}
    by = roles(tier)
    next_row = 0
    for role, g in by.items():
        plan = tier._plans[g]
        keys, t = req.keys[g], plan.tokens_per_chunk
        if role == HISTORY:
            chosen = list(range(len(keys)))
        else:
            ends = range(256, TOKENS + 1, 256) if dense else [TOKENS]
            chosen = sorted({e // t - 1 - j for e in ends for j in range(plan.window_chunks)})
        for i in chosen:
            if skip == (role, i - len(keys)):
                continue
            env.primary[next_row] = rng.integers(0, 256, ROW, dtype=np.uint8)
            rows[keys[i]] = next_row
            next_row += 1
    keys = list(rows)
    assert run_job(tier, keys, [rows[k] for k in keys], req.ctx, load=False).success
    return rows


def hits(tier: KvtierSecondaryTier, req: Request) -> dict[str, int]:
    return {role: scan(tier, req, g, tier._plans[g].window_chunks) for role, g in roles(tier).items()}


def test_a_fresh_engine_hits_every_group_and_reads_back_every_row(env) -> None:
    first = env.tier()
    prompt = block_hashes(1, TOKENS // 4)
    rows = store_request(env, first, Request(env, prompt, "store"), dense=True)
    first.shutdown()

    second = env.tier()  # a new engine: nothing in memory, everything from the store
    assert hits(second, Request(env, prompt, "repeat")) == dict.fromkeys(roles(second), TOKENS)
    # A prompt sharing 600 tokens: dense retention kept whole windows at 512, so every group hits 512.
    shared = Request(env, block_hashes(2, TOKENS // 4, shared=150, base_seed=1), "shared")
    assert hits(second, shared) == dict.fromkeys(roles(second), 512)

    keys = list(rows)
    dest = [2048 + i for i in range(len(keys))]
    result = run_job(second, keys, dest, Request(env, prompt, "load").ctx, load=True)
    assert result.success
    for k, d in zip(keys, dest):
        assert np.array_equal(env.primary[d], env.primary[rows[k]])  # row for row

    code, report = kvtier_audit(env.store)
    assert code == 0 and report["corrupt"] == 0
    forms = [{f: v["entries"] for f, v in n["forms"].items() if v["entries"]} for n in report["namespaces"]]
    assert [f for f in forms if f] == [
        {
            "compressed": 4,  # the history group: C4 + C128 attention and indexer keys, one row per chunk
            "swa": 2 * 4 * 2,  # two SWA groups, a 2-chunk window at each of 4 boundaries
            "tail": 4 * 2 + 4 * 16,  # C4 states: 2-chunk windows; C128 states: 16-chunk windows
        }
    ]


def test_faults_miss_or_recompute_never_a_wrong_row(env) -> None:
    first = env.tier()
    prompt = block_hashes(1, TOKENS // 4)
    rows = store_request(env, first, Request(env, prompt, "store"), dense=False)
    by = roles(first)
    first.shutdown()

    # A flipped byte in one history record: that chunk's load fails, its slot is untouched; vLLM recomputes.
    tier = env.tier()
    req = Request(env, prompt, "corrupt")
    flip_payload_byte(env.store, tier._plans[by[HISTORY]].name, nth=0, store=None if env.daemon else tier._store)
    keys = req.keys[by[HISTORY]]
    env.primary[3000:3004] = 0xAB
    result = run_job(tier, keys, [3000, 3001, 3002, 3003], req.ctx, load=True)
    assert not result.success and len(result.successful_keys) == 3
    (bad,) = set(keys) - set(result.successful_keys)
    assert (env.primary[3000 + keys.index(bad)] == 0xAB).all()
    for k in result.successful_keys:
        assert np.array_equal(env.primary[3000 + keys.index(k)], env.primary[rows[k]])
    assert tier.lookup(bad, req.ctx) is LookupResult.MISS
    tier.shutdown()

    # The last SWA chunk of a window never stored (evicted, or lost): that window is a MISS, never partial.
    other = block_hashes(3, TOKENS // 4)
    tier = env.tier()
    store_request(env, tier, Request(env, other, "store-hole"), dense=False, skip=(SWA_A, -1))
    req = Request(env, other, "hole")
    assert scan(tier, req, by[SWA_A], tier._plans[by[SWA_A]].window_chunks) == 0
    assert tier.lookup(req.keys[by[SWA_A]][-2], req.ctx) is LookupResult.MISS  # stored, but its window has a hole
    assert scan(tier, req, by[SWA_B], tier._plans[by[SWA_B]].window_chunks) == TOKENS  # the other group's is whole
    tier.shutdown()

    # A changed compress_ratios (same weights, same groups): a new namespace, 0 hits.
    changed = write_dsv4_checkpoint(env.model.parent / "changed", compress_ratios=[*RATIOS, 4])
    tier = env.tier(changed)
    assert hits(tier, Request(env, prompt, "changed")) == dict.fromkeys(by, 0)
