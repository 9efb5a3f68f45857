"""bench/peers.py's kvtier side on a small workload: the benchmark reaches into the store's read path (its layout
read builds native-AIO reads itself), so a change there that the benchmark does not follow fails here, not in a
`bench/run_all.py` run that reports an error where the peers ratio should be."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.store import aio
from support.verifier_helpers import REPO


def test_kvtier_reads_back_what_it_wrote_and_its_layout_read_runs(tmp_path: Path) -> None:
    args = ("--stores", "kvtier", "--tokens", "512", "--repeat", "1", "--dir", str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "bench/peers.py", *args], capture_output=True, text=True, timeout=180, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    kvtier = json.loads(proc.stdout)["stores"]["kvtier"]
    assert "error" not in kvtier, kvtier.get("error")
    assert kvtier["read_back_correct"] is True and kvtier["cold_read_MBps"] > 0
    assert kvtier["restart"]["finds_its_data"] is True
    ctx = aio.acquire()
    if ctx is not None and kvtier["io_backend"] == "odirect":  # the layout read goes through native AIO
        aio.release(ctx)
        assert kvtier["layout_read_MBps"] > 0


PEERS_PYTHON = Path(REPO) / "bench" / ".venv-peers" / "bin" / "python"


@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="no peers venv: bench/run_all.py --only peers creates it")
def test_lmcache_reads_every_object_with_o_direct(tmp_path: Path) -> None:
    # LMCache takes O_DIRECT only for buffers a whole number of blocks long: the bench pads its objects, and counts
    # in LMCache's own read path that every cold read opened its file with O_DIRECT
    args = ("--stores", "kvtier", "lmcache", "--tokens", "1024", "--repeat", "1", "--dir", str(tmp_path))
    proc = subprocess.run(
        [str(PEERS_PYTHON), "bench/peers.py", *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    lm = out["stores"]["lmcache"]
    assert "error" not in lm, lm.get("error")
    assert lm["read_back_correct"] is True and lm["padding_bytes"] > 0
    assert lm["reads"] >= out["workload"]["objects"] and lm["odirect_reads"] == lm["reads"]
    assert out["lmcache_odirect"] is True
