"""bench/vllm_dsv4.py, run small: kvtier and vLLM's fs tier alternate ABBA, every load job found both sides'
files out of the page cache, and the ratios are of the medians printed beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 3
SMALL = ["--tokens", "1024", "--rows", "2", "--repeats", "1"]


def test_bench_alternates_abba_and_loads_cold(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_dsv4.py"), *SMALL, "--rounds", str(ROUNDS)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    abba = ["kvtier", "fs", "fs", "kvtier", "kvtier", "fs"]
    assert out["order"] == abba
    assert [r["side"] for r in out["rounds"]] == abba
    assert [r["round"] for r in out["rounds"]] == [0, 0, 1, 1, 2, 2]
    assert out["cache"] == "cold"
    for r in out["rounds"]:
        assert r["cache"] == "cold" and r["resident_bytes"] == 0 and r["file_bytes"] > 0, r
    for r in out["rounds"][1:]:  # from the second run on, the other side's files exist and were evicted too
        assert r["other_side"]["cache"] == "cold" and r["other_side"]["file_bytes"] > 0, r
    for way in ("store", "load"):
        spread = out[f"kvtier_{way}_mb_per_s_rounds"]
        assert spread["min"] <= out[f"kvtier_{way}_mb_per_s"] <= spread["max"]
        ratio = out[f"kvtier_{way}_mb_per_s"] / out[f"fs_{way}_mb_per_s"]
        assert out[f"{way}_ratio_kvtier_vs_fs"] == round(ratio, 3)
