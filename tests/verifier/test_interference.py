"""Readers loading pinned records while the verifier sweeps, evicts and compacts: never a wrong byte or a miss.

The quick version of bench/verifier.py (which measures the p99 ratio properly, on a quiet machine): here the
correctness counts are exact and the latency bound is a sanity bound, since this machine's other load is
larger than the 20% being measured.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.verifier_helpers import REPO


@pytest.mark.alone  # its p99 ratio is a latency another worker's test would move
def test_readers_see_no_wrong_bytes_or_misses_while_the_verifier_works() -> None:
    res = subprocess.run(
        [sys.executable, "bench/verifier.py", "--quick", "--only", "reads"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["wrong_bytes"] == 0 and doc["pinned_misses"] == 0 and doc["errors"] == 0
    assert doc["with"]["loads"] > 500 and doc["without"]["loads"] > 500
    actions = doc["verifier_actions"]
    # the verifier really worked during the 'with' windows: swept, evicted, relocated pinned records, unlinked segments
    # (--quick adds windows until it has, up to 4x: at nice 19 on a busy machine it may need longer)
    assert doc["windows"] >= 24 and actions["verified"] >= doc["records"] // 2 and actions["evicted"] > 0
    assert actions["relocated"] > 0 and actions["segments_unlinked"] > 0 and actions.get("quarantined", 0) == 0
    # ...and in those windows, not before the first one: the compaction copies (O_DIRECT, counted by /proc/<pid>/io
    # as they are submitted) and the applier's commits for it land there (a store built over its budget had the
    # verifier evict and compact in its first pass, before the readers started)
    in_windows = doc["breakdown"]
    assert in_windows["verifier_write_MB"] * 1e6 >= actions["relocated_bytes"] / 2, in_windows
    assert in_windows["index_changes_applied"] > 0, in_windows
    assert doc["window_p99_median_ratio"] <= 1.5, doc
    # its index changes (its evictions among them) went through the applier, as beside a daemon
    assert doc["index_writer"].startswith("applier") and doc["index_changes_applied"] > 0, doc


@pytest.mark.alone  # latencies another worker's test would move
def test_durable_offloads_through_the_daemon_while_its_verifier_is_stopped_at_random() -> None:
    """bench/verifier_offloads.py --quick: a real daemon, its verifier evicting and stopped at random, two CPU hogs;
    nothing acknowledged is lost, and no offload waits anywhere near a stop's length of 1 s (a sanity bound: the
    bench measures the ratio to the control)."""
    res = subprocess.run(
        [sys.executable, "bench/verifier_offloads.py", "--quick"], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["errors"] == 0 and doc["acknowledged_objects"] > 0 and doc["acknowledged_lost"] == 0, doc
    assert doc["random_stops"] > 0 and doc["verifier_actions"].get("evicted", 0) > 0, doc
    assert doc["stopping"]["n"] > 0 and doc["control"]["n"] > 0, doc
    assert doc["stopping"]["max_ms"] < 2000, doc
    for side in (doc["stopping"], doc["control"]):  # the calls that stored all and those that stored none, apart
        assert side["all_durable"]["n"] + side["none_durable"]["n"] <= side["n"], side
        assert side["all_durable_share"] == round(side["all_durable"]["n"] / side["n"], 3), side
