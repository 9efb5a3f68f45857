"""Two nodes in two network namespaces joined by a veth pair (issue 40): node 2's restore crosses a real link,
shaped by tc, and is bitwise what node 1 put. Runs bench/cluster_link.py small; needs root, ip and tc (CI
without them keeps the loopback tests, and this one skips with one line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cluster_link import why_not

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(why_not() is not None, reason=f"no network namespaces here: {why_not()}")
def test_node2_restores_across_a_shaped_veth_link() -> None:
    small = ["--objects", "8", "--rates", "0.5", "--repeat", "1", "--link-bytes", str(16 << 20)]
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cluster_link.py"), *small],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]  # a restore that is not bitwise exits non-zero
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    (one,) = doc["runs"]
    assert one["shaped"] == "0.5 Gbit/s" and one["shaper"] != "none", one
    assert 0 < one["link_gbps"] < 0.6, one  # the shaper holds the stream to its rate
    assert one["restore_MBps"] > 0 and one["ratio_to_link"] < 1.1, one  # no restore beats the link it crosses
    assert doc["shaped_ratio_to_link_min"] == one["ratio_to_link"]  # the acceptance line's figure
    # the states are what they say: the cold read starts with the files out of the page cache, the warm one in it
    assert one["disk_cold_resident"] < 0.05 and one["disk_warm_resident"] > 0.95, one
    assert "holder RAM" in one["cluster_state"] and one["restore_first_MBps"] > 0 and one["device_direct_MBps"] > 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvtbench-" not in listed, listed  # the namespaces went with the run
