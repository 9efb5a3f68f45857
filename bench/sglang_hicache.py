"""DeepSeek-V4 HiCache pages through kvtier vs SGLang's HiCacheFile, side by side in one run; prints one JSON object.

Both backends get the same host pools (DSV4's six data pools plus the logical KV anchor, 256-token pages,
DeepSeek-V4-Flash's bytes per layer, `--layers` layers per pool) and the same calls SGLang's cache
controller makes: `batch_set_v2` for the pools and `batch_set` for the anchor (backup), then
`batch_exists_v2` and `batch_get_v2` (prefetch). kvtier's time includes its writer draining
(`flush`), so both columns count pages durable-or-written, not merely queued; HiCacheFile does not fsync,
kvtier does (fdatasync per batch).

Each side writes and reads the request --rounds times in ABBA order (kvtier, HiCacheFile, HiCacheFile,
kvtier, ...), each round into a fresh folder; before every timed read the page cache of the files both sides
wrote is dropped (bench/abba.py says how, and how it is checked), so HiCacheFile's buffered reads come
from the disk, as kvtier's O_DIRECT reads do. `rounds` lists every round with its side, order and cache
state; per side the medians (`set_s`, `get_s`, ...) and their spread (`*_rounds`).

Needs SGLang: run it with the SGLang venv's python (tests/sglang/run.sh --prepare builds bench/.venv-sglang):
    bench/.venv-sglang/bin/python bench/sglang_hicache.py --pages 64
`ratio` = HiCacheFile's median seconds / kvtier's (> 1: kvtier is faster); each side's own medians beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import abba as A  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE as BATCH  # noqa: E402

import support.sglang_pools as D  # noqa: E402  (the same fakes and calls the tests use)

SIDES = ("kvtier", "hicache_file")
CACHE_DROP = "posix_fadvise(DONTNEED) on every file both sides wrote, before each timed read; probed with mincore"


def timed_set(backend, host: D.Dsv4Host, keys: list[str], slots: list[int], flush) -> float:
    """Seconds to back up every page the way SGLang's controller does, and drain `flush`."""
    started = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        D.backup(backend, host, keys[i : i + BATCH], slots[i : i + BATCH], set())
    D.backup(backend, host, keys[-1:], slots[-1:], {0})  # the state pools at the request's end
    flush()
    return time.perf_counter() - started


def timed_get(backend, host: D.Dsv4Host, keys: list[str], slots: list[int]) -> tuple[float, int]:
    """Seconds of the prefetch: `batch_exists_v2`, then `batch_get_v2` batch by batch; and the pages hit."""
    started = time.perf_counter()
    pages, _ = D.query(backend, keys)
    for i in range(0, len(keys), BATCH):
        got = D.load(backend, host, keys[i : i + BATCH], slots[i : i + BATCH])
        assert all(all(v) for v in got.values()), f"a page did not load: {got}"
    return time.perf_counter() - started, pages


def side_summary(rounds: list[dict], side: str, nbytes: int) -> dict:
    """One side's medians (the keys a single pass used to print) and each phase's spread over the rounds."""
    mine = [r for r in rounds if r["side"] == side]
    set_s = A.spread([r["set_s"] for r in mine])
    get_s = A.spread([r["get_s"] for r in mine])
    return {
        "set_s": set_s["median"],
        "get_s": get_s["median"],
        "set_gbps": round(nbytes / set_s["median"] / 1e9, 3),
        "get_gbps": round(nbytes / get_s["median"] / 1e9, 3),
        "hit_pages": min(r["hit_pages"] for r in mine),
        "history_pools_byte_exact": all(r["history_pools_byte_exact"] for r in mine),
        "set_s_rounds": set_s,
        "get_s_rounds": get_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64, help="256-token pages per request")
    ap.add_argument("--layers", type=int, default=4, help="layers per pool (DSV4-Flash: 21 C4, 19 C128, 43 SWA)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, each side once a round, in ABBA order (>= 3)")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3: a median and a spread need three rounds a side")
    order = A.abba(*SIDES, args.rounds)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        model = D.launched_dsv4(work / "model")  # the resolved launch the backend identifies
        host = D.Dsv4Host(args.pages, args.layers)
        host.fill(seed=0)
        written = host.snapshot()
        history = [g.name for g in D.DSV4_POOLS if g.policy is D.ALL]
        keys, slots = D.chain("bench", args.pages), list(range(args.pages))
        rounds = []
        for i, side in enumerate(order):
            folder = work / side / str(i // 2)  # a fresh store a round: the files this round's writes made
            host.fill(seed=0)
            if side == "kvtier":
                backend = D.kvtier_backend(host, model, store_dir=str(folder))
                set_s = timed_set(backend, host, keys, slots, lambda b=backend: b.flush(600))
            else:
                backend = D.file_backend(host, folder)
                set_s = timed_set(backend, host, keys, slots, lambda: None)
            host.clear()
            cache = A.evict({s: [work / s] for s in SIDES if (work / s).exists()})
            get_s, pages = timed_get(backend, host, keys, slots)
            exact = all(torch.equal(host.pools[n].kv_buffer, written[n]) for n in history)
            if side == "kvtier":
                backend.close()
            rounds.append(
                {
                    "round": i // 2,
                    "side": side,
                    "set_s": round(set_s, 4),
                    "get_s": round(get_s, 4),
                    "hit_pages": pages,
                    "history_pools_byte_exact": exact,
                    **cache[side],
                    "other_side": cache.get(SIDES[1 - SIDES.index(side)]),
                }
            )
    # Bytes moved each way: every page of the history pools, one page (the request's end) of the state pools.
    nbytes = sum(
        host.pools[g.name].kv_buffer[0].numel() * (args.pages if g.policy is D.ALL else 1) for g in D.DSV4_POOLS
    )
    kv, hf = side_summary(rounds, "kvtier", nbytes), side_summary(rounds, "hicache_file", nbytes)
    page_bytes = sum(p.kv_buffer[0].numel() for p in host.pools.values())
    print(
        json.dumps(
            {
                "bench": "sglang_hicache",
                "pages": args.pages,
                "layers": args.layers,
                "bytes_per_page_all_pools": page_bytes,
                "order": order,
                "cache_drop": CACHE_DROP,
                "cache": A.overall(rounds),
                "kvtier": kv,
                "hicache_file": hf,
                "ratio": {
                    "set": round(hf["set_s"] / kv["set_s"], 3),
                    "get": round(hf["get_s"] / kv["get_s"], 3),
                },
                "rounds": rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
