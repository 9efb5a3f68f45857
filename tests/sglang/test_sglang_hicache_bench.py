"""bench/sglang_hicache.py, run small: the sides alternate ABBA, every timed read found both sides' files out of
the page cache, both sides read back every history page bitwise, and the ratios are of the medians printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import support.sglang_pools  # noqa: F401  (first: it skips this module unless SGLang imports)

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 3
SMALL = ["--pages", "2", "--layers", "1", "--rounds", str(ROUNDS)]


def test_bench_alternates_abba_and_reads_cold(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sglang_hicache.py"), *SMALL, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    abba = ["kvtier", "hicache_file", "hicache_file", "kvtier", "kvtier", "hicache_file"]
    assert out["order"] == abba
    assert [r["side"] for r in out["rounds"]] == abba
    assert [r["round"] for r in out["rounds"]] == [0, 0, 1, 1, 2, 2]
    assert out["cache"] == "cold"
    for r in out["rounds"]:
        assert r["cache"] == "cold" and r["resident_bytes"] == 0 and r["file_bytes"] > 0, r
        assert r["hit_pages"] == 2 and r["history_pools_byte_exact"], r
    for r in out["rounds"][1:]:  # from the second run on, the other side's files exist and were evicted too
        assert r["other_side"]["cache"] == "cold" and r["other_side"]["file_bytes"] > 0, r
    kv, hf = out["kvtier"], out["hicache_file"]
    assert kv["get_s_rounds"]["min"] <= kv["get_s"] <= kv["get_s_rounds"]["max"]
    assert out["ratio"]["get"] == round(hf["get_s"] / kv["get_s"], 3)
    assert out["ratio"]["set"] == round(hf["set_s"] / kv["set_s"], 3)
