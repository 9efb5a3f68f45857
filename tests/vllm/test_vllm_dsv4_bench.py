"""bench/vllm_dsv4.py, run small: kvtier and vLLM's fs tier alternate ABBA, every load job found both sides'
files out of the page cache, and the ratios are of the medians printed beside them."""

from __future__ import annotations

from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

from support.bench_rounds import assert_abba_cold, run_bench  # noqa: E402

ROUNDS = 3


def test_bench_alternates_abba_and_loads_cold(tmp_path: Path) -> None:
    args = ["--tokens", "1024", "--rows", "2", "--repeats", "1", "--rounds", str(ROUNDS)]
    out = run_bench("vllm_dsv4.py", args, tmp_path)

    assert_abba_cold(out, "kvtier", "fs", ROUNDS)
    for way in ("store", "load"):
        spread = out[f"kvtier_{way}_mb_per_s_rounds"]
        assert spread["min"] <= out[f"kvtier_{way}_mb_per_s"] <= spread["max"]
        ratio = out[f"kvtier_{way}_mb_per_s"] / out[f"fs_{way}_mb_per_s"]
        assert out[f"{way}_ratio_kvtier_vs_fs"] == round(ratio, 3)
