"""DeepSeek-V4 HiCache pages through kvtier vs SGLang's HiCacheFile, side by side in one run; prints one JSON object.

Both backends get the same host pools (DSV4's six data pools plus the logical KV anchor, 256-token pages,
DeepSeek-V4-Flash's bytes per layer, `--layers` layers per pool) and the same calls SGLang's cache
controller makes: `batch_set_v2` for the pools and `batch_set` for the anchor (backup), then
`batch_exists_v2` and `batch_get_v2` + `batch_get` (prefetch). kvtier's time includes its writer draining
(`flush`), so both columns count pages durable-or-written, not merely queued; HiCacheFile does not fsync,
kvtier does (fdatasync per batch).

Needs SGLang: run it with the SGLang venv's python (tests/sglang/run.sh --prepare builds bench/.venv-sglang):
    bench/.venv-sglang/bin/python bench/sglang_hicache.py --pages 64
`ratio` = HiCacheFile's seconds / kvtier's (> 1: kvtier is faster).
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

from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE as BATCH  # noqa: E402

import support.sglang_pools as D  # noqa: E402  (the same fakes and calls the tests use)


def run(backend, host: D.Dsv4Host, keys: list[str], slots: list[int], flush) -> dict[str, float]:
    # Bytes moved each way: every page of the history pools, one page (the request's end) of the state pools.
    nbytes = sum(
        host.pools[g.name].kv_buffer[0].numel() * (len(slots) if g.policy is D.ALL else 1) for g in D.DSV4_POOLS
    )
    started = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        D.backup(backend, host, keys[i : i + BATCH], slots[i : i + BATCH], set())
    D.backup(backend, host, keys[-1:], slots[-1:], {0})  # the state pools at the request's end
    flush()
    set_s = time.perf_counter() - started
    host.clear()
    started = time.perf_counter()
    pages, _ = D.query(backend, keys)
    ok = 0
    for i in range(0, len(keys), BATCH):
        got = D.load(backend, host, keys[i : i + BATCH], slots[i : i + BATCH])
        ok += sum(min(v) for v in got.values())
    get_s = time.perf_counter() - started
    return {
        "set_s": round(set_s, 4),
        "get_s": round(get_s, 4),
        "set_gbps": round(nbytes / set_s / 1e9, 3),
        "get_gbps": round(nbytes / get_s / 1e9, 3),
        "hit_pages": pages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64, help="256-token pages per request")
    ap.add_argument("--layers", type=int, default=4, help="layers per pool (DSV4-Flash: 21 C4, 19 C128, 43 SWA)")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model = D.write_checkpoint(Path(tmp) / "model")
        D.launch(model)  # the resolved launch the backend identifies (as a scheduler publishes it)
        host = D.Dsv4Host(args.pages, args.layers)
        host.fill(seed=0)
        written = host.snapshot()
        keys, slots = D.chain("bench", args.pages), list(range(args.pages))
        kv = D.kvtier_backend(host, model, store_dir=str(Path(tmp) / "kvtier"))
        kv_result = run(kv, host, keys, slots, lambda: kv.flush(600))
        history = [g.name for g in D.DSV4_POOLS if g.policy is D.ALL]
        kv_exact = all(torch.equal(host.pools[n].kv_buffer, written[n]) for n in history)
        kv.close()
        host.fill(seed=0)
        hf = D.file_backend(host, Path(tmp) / "hicache")
        hf_result = run(hf, host, keys, slots, lambda: None)
    page_bytes = sum(p.kv_buffer[0].numel() for p in host.pools.values())
    print(
        json.dumps(
            {
                "bench": "sglang_hicache",
                "pages": args.pages,
                "layers": args.layers,
                "bytes_per_page_all_pools": page_bytes,
                "kvtier": {**kv_result, "history_pools_byte_exact": kv_exact},
                "hicache_file": hf_result,
                "ratio": {
                    "set": round(hf_result["set_s"] / kv_result["set_s"], 3),
                    "get": round(hf_result["get_s"] / kv_result["get_s"], 3),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
