"""bench/sglang_hicache.py, run small: the sides alternate ABBA, every timed read found both sides' files out of
the page cache, both sides read back every history page bitwise, and the ratios are of the medians printed."""

from __future__ import annotations

from pathlib import Path

import support.sglang_pools  # noqa: F401  (first: it skips this module unless SGLang imports)
from support.bench_rounds import assert_abba_cold, run_bench

ROUNDS = 3


def test_bench_alternates_abba_and_reads_cold(tmp_path: Path) -> None:
    args = ["--pages", "2", "--layers", "1", "--rounds", str(ROUNDS), "--dir", str(tmp_path)]
    out = run_bench("sglang_hicache.py", args, tmp_path)

    assert_abba_cold(out, "kvtier", "hicache_file", ROUNDS)
    for r in out["rounds"]:
        assert r["hit_pages"] == 2 and r["history_pools_byte_exact"], r
    kv, hf = out["kvtier"], out["hicache_file"]
    assert kv["get_s_rounds"]["min"] <= kv["get_s"] <= kv["get_s_rounds"]["max"]
    assert out["ratio"]["get"] == round(hf["get_s"] / kv["get_s"], 3)
    assert out["ratio"]["set"] == round(hf["set_s"] / kv["set_s"], 3)
