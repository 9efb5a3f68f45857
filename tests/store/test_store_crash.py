"""Crash safety: a writer kill -9'ed at random points 50 times loses nothing it acknowledged."""

from __future__ import annotations

import json
import subprocess
import sys

from support.store_crashloop import crash_loop, unreferenced_bytes_independent
from support.store_helpers import subprocess_env


def test_kill_minus_9_fifty_times_loses_no_acknowledged_record(tmp_path) -> None:
    root = str(tmp_path / "store")
    result = crash_loop(root, kills=50, seed=1234)
    assert result.kills == 50 and result.acked > 50
    assert result.orphan_rounds >= 1, "no kill landed between a payload write and its commit"
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "store", "rebuild-index", "--store", root, "--dry-run", "--json"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["dry_run"] and report["unreferenced_bytes"] == unreferenced_bytes_independent(root) > 0
