"""DeepSeek-V4 through the kvtier vLLM tier: lookup cost of a 128K-token request, and 1 MB row throughput.

Run in the vLLM venv (tests/vllm/run.sh --prepare builds it):
    bench/.venv-vllm/bin/python bench/vllm_dsv4.py [--tokens 131072] [--rows 64]
Prints one JSON object. The groups are the five vLLM 0.32 forms for a DSV4 checkpoint (tests/support/vllm_dsv4.py);
lookups follow the connector's scans on a fresh tier (its key set just read from the store, no answer cached
for the request): a prefix over the history group, then from the end a whole window over each state group;
wall time and the scanning thread's CPU time (fastest and median of --repeats; CPU time is what a busy machine
disturbs less), and how long the tier took at start to read the namespace's keys into memory.
Throughput: a store job and a load job of --rows rows of vLLM's packed DSV4 block (1,002,240 B; 1,003,520 B
aligned, as vLLM's CPU tier holds it) through kvtier (store opened in-process, fdatasync per job) and through
vLLM's own `fs` tier (a file per chunk, O_DIRECT, no fsync) on the same rows, --rounds times each in ABBA order
(kvtier, fs, fs, kvtier, ...), each round in a fresh folder, the page cache of the files both sides wrote
dropped before every load job (bench/abba.py says how, and how it is checked); per side the median MB/s and
its spread, and the ratios of the medians. `rounds` lists every round with its order and cache state.
"""

from __future__ import annotations

import json
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the DSV4 groups and the connector's calls

import abba as A

from kvtier.integrations.vllm.tier import KvtierSecondaryTier
from support.vllm_dsv4 import ChunkKeys, block_hashes, dsv4_offloading_config, run_job, scan
from support.vllm_dsv4_model import write_dsv4_checkpoint


def tier(config, primary: np.ndarray, store: Path, engine) -> KvtierSecondaryTier:
    """kvtier's tier over `config`, handed the VllmConfig it came from (`engine`), as vLLM's connector would."""
    return KvtierSecondaryTier(
        SimpleNamespace(config=config),
        memoryview(primary),
        "KvtierSecondaryTier",
        store_dir=str(store),
        vllm_config=engine,
    )


def fs_tier(config, primary: np.ndarray, root: Path):
    """vLLM's own file-system secondary tier over the same primary rows."""
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    spec = SimpleNamespace(
        config=config, blocks_per_chunk=1, kv_events_config=SimpleNamespace(enable_kv_cache_events=False)
    )
    return FileSystemTierManager(spec, memoryview(primary), "fs", root_dir=str(root))


def lookups(small, engine, work: Path, tokens: int, repeats: int) -> dict:
    """The connector's scans of one request on fresh tiers: fastest and median of `repeats`."""
    primary = np.random.default_rng(0).integers(0, 256, (1024, 4096), dtype=np.uint8)
    writer = tier(small, primary, work / "lookups", engine)
    prompt = block_hashes(1, tokens // 4)
    req = ChunkKeys(small, prompt, "store")
    keys = []  # what vLLM keeps for one request: every history chunk, the windows at its end
    for g, plan in writer._plans.items():
        k = req.keys[g]
        keys += k if plan.window_chunks == 0 else k[-plan.window_chunks :]
    for i in range(0, len(keys), 256):  # max_pending_store_chunks
        batch = keys[i : i + 256]
        assert run_job(writer, batch, list(range(len(batch))), req.ctx, load=False).success
    writer.shutdown()
    wall, cpu, load, asked = [], [], [], 0
    for r in range(repeats):
        fresh = tier(small, primary, work / "lookups", engine)
        load.append(fresh._keys.load_s)
        again = ChunkKeys(small, prompt, f"repeat{r}")
        calls = 0

        def counted(key, ctx, lookup=fresh.lookup):
            nonlocal calls
            calls += 1
            return lookup(key, ctx)

        fresh.lookup = counted
        started, started_cpu = time.perf_counter(), time.thread_time()
        hit = {g: scan(fresh, again, g, p.window_chunks) for g, p in fresh._plans.items()}
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
        fresh.shutdown()
        assert set(hit.values()) == {tokens}, hit
        asked = calls
    return {
        "tokens": tokens,
        "lookups": asked,
        "lookup_total_ms_min": round(min(wall) * 1e3, 3),
        "lookup_total_ms_median": round(statistics.median(wall) * 1e3, 3),
        "lookup_cpu_ms_min": round(min(cpu) * 1e3, 3),
        "lookup_cpu_ms_median": round(statistics.median(cpu) * 1e3, 3),
        "records_in_memory": len(fresh._keys),
        "key_set_load_ms_median": round(statistics.median(load) * 1e3, 3),
        "lookups_per_s": round(asked / min(wall)),
    }


SIDES = ("kvtier", "fs")
CACHE_DROP = "posix_fadvise(DONTNEED) on every file both sides wrote, before each timed load; probed with mincore"


def rows_round(t, full, big: np.ndarray, rows: int, block: int, evict) -> dict:
    """One store job and one load job of `rows` packed DSV4 rows through the tier `t`; `evict()` runs between
    them (untimed) and says what it left in memory. MB/s each way."""
    req = ChunkKeys(full, block_hashes(2, rows * 64), "rows")
    row_keys = req.keys[next(g.group_id for g in full.groups if g.tokens_per_block == 256)][:rows]  # history
    big[rows:] = 0
    started = time.perf_counter()
    assert run_job(t, row_keys, list(range(rows)), req.ctx, load=False).success
    store_s = time.perf_counter() - started
    cache = evict()
    started = time.perf_counter()
    assert run_job(t, row_keys, list(range(rows, 2 * rows)), req.ctx, load=True).success
    load_s = time.perf_counter() - started
    t.shutdown()
    assert np.array_equal(big[:rows], big[rows:])
    mb = rows * block / 1e6
    return {"store_mb_per_s": round(mb / store_s, 1), "load_mb_per_s": round(mb / load_s, 1), "cache": cache}


def throughput(full, engine, work: Path, rows: int, block: int, rounds: int) -> dict:
    """kvtier (store_dir) and vLLM's fs tier on the same rows, in ABBA order over `rounds` rounds, each in a
    fresh folder, the page cache of both sides' files dropped before every load job."""
    # Page-aligned rows of the aligned row size, as vLLM's shared region gives them (the fs tier uses O_DIRECT).
    big = np.frombuffer(mmap.mmap(-1, 2 * rows * block), dtype=np.uint8).reshape(2 * rows, block)
    big[:rows] = np.random.default_rng(1).integers(0, 256, (rows, block), dtype=np.uint8)
    order = A.abba(*SIDES, rounds)
    per_round = []
    for i, side in enumerate(order):
        folder = work / side / str(i // 2)
        t = tier(full, big, folder, engine) if side == "kvtier" else fs_tier(full, big, folder)
        got = rows_round(
            t, full, big, rows, block, lambda: A.evict({s: [work / s] for s in SIDES if (work / s).exists()})
        )
        cache = got.pop("cache")
        other = SIDES[1 - SIDES.index(side)]
        per_round.append({"round": i // 2, "side": side, **got, **cache[side], "other_side": cache.get(other)})
    out: dict = {"order": order, "cache_drop": CACHE_DROP}
    out["cache"] = A.overall(per_round)
    for side in SIDES:
        for way in ("store", "load"):
            s = A.spread([r[f"{way}_mb_per_s"] for r in per_round if r["side"] == side], digits=1)
            out[f"{side}_{way}_mb_per_s"] = s["median"]
            out[f"{side}_{way}_mb_per_s_rounds"] = s
    for way in ("store", "load"):
        out[f"{way}_ratio_kvtier_vs_fs"] = round(out[f"kvtier_{way}_mb_per_s"] / out[f"fs_{way}_mb_per_s"], 3)
    out["rounds"] = per_round
    return out


@click.command()
@click.option("--tokens", default=131072, help="prompt length of the lookup measurement")
@click.option("--rows", default=64, help="1 MB rows stored and loaded for the throughput measurement")
@click.option("--repeats", default=7, help="fresh tiers the lookup scan runs on")
@click.option("--rounds", default=4, help="throughput rounds, each side once a round, in ABBA order (>= 3)")
def main(tokens: int, rows: int, repeats: int, rounds: int) -> None:
    if rounds < 3:
        raise click.BadParameter("a median and a spread need three rounds a side", param_hint="--rounds")
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-dsv4-"))
    model = write_dsv4_checkpoint(work / "model")
    small, block, engine = dsv4_offloading_config(model, 4096)
    out = lookups(small, engine, work, tokens, repeats)

    # Throughput: rows of vLLM's packed DSV4 block size, kvtier (store_dir) vs vLLM's fs tier, ABBA, cold loads.
    block = -(-block // TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT) * TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    full, _, engine = dsv4_offloading_config(model, block)
    out.update(row_bytes=block, rows=rows, **throughput(full, engine, work / "rows", rows, block, rounds))
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
