"""bench/verifier.py's reads part measures the verifier's writing beside the readers: the eviction, compaction copies
and index changes it is meant to overlap land in the running windows, not before the first one. (A store built over
its budget had the verifier evict and compact in its first pass, before the readers started, so its 'writing
windows' were those in which it wrote its status document.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "verifier.py"


@pytest.mark.slow
def test_the_verifiers_compaction_lands_in_the_running_windows(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "reads", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    out = json.loads(run.stdout)
    relocated = out["verifier_actions"]["relocated_bytes"]
    assert relocated > 0 and out["verifier_actions"]["evicted"] > 0
    in_windows = out["breakdown"]
    # the copies are written once each, O_DIRECT (counted by /proc/<pid>/io as they are submitted)
    assert in_windows["verifier_write_MB"] * 1e6 >= relocated / 2
    assert in_windows["index_changes_applied"] > 0  # the evictions, repoints, unlinks: committed for it in windows
    assert out["wrong_bytes"] == out["pinned_misses"] == out["errors"] == 0
