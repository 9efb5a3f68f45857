"""Running an engine bench (bench/sglang_hicache.py, bench/vllm_dsv4.py) small in this interpreter, and what
its rounds must show: the two sides in ABBA order, and every timed read on files out of the page cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, args: list[str], tmp: Path) -> dict:
    """The JSON object `bench/<script>` prints, run with `args` (temporary files under `tmp`)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "TMPDIR": str(tmp)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_abba_cold(out: dict, a: str, b: str, rounds: int) -> None:
    """`out["rounds"]` ran a, b, b, a, ... and found each side's files, and the other side's, cold."""
    order = [s for r in range(rounds) for s in ((a, b) if r % 2 == 0 else (b, a))]
    assert out["order"] == order
    assert [r["side"] for r in out["rounds"]] == order
    assert [r["round"] for r in out["rounds"]] == [i // 2 for i in range(2 * rounds)]
    assert out["cache"] == "cold"
    for r in out["rounds"]:
        assert r["cache"] == "cold" and r["resident_bytes"] == 0 and r["file_bytes"] > 0, r
    for r in out["rounds"][1:]:  # from the second run on, the other side's files exist and were evicted too
        assert r["other_side"]["cache"] == "cold" and r["other_side"]["file_bytes"] > 0, r
