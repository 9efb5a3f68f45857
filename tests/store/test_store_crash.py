"""Crash safety: a writer kill -9'ed at random points loses nothing it acknowledged.

Every kill is followed by the full check (every record acknowledged so far reads back exactly, nothing visible
that was never attempted, rebuild-index's orphan count equals an independent one), so each kill is a trial of
the property on its own. Twenty kills are enough for several to land inside a store() between its payload
write and its index commit (the case that leaves orphaned bytes, asserted below), as most kills are aimed inside
a store() (support/store_crashloop.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

from support.store_crashloop import crash_loop, unreferenced_bytes_independent
from support.store_helpers import subprocess_env

KILLS = 20


def test_kill_minus_9_twenty_times_loses_no_acknowledged_record(tmp_path) -> None:
    root = str(tmp_path / "store")
    result = crash_loop(root, kills=KILLS, seed=1234)
    assert result.kills == KILLS and result.acked > KILLS
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
