"""bench/peers.py's kvtier side on a small workload: the benchmark reaches into the store's read path (its layout
read builds native-AIO reads itself), so a change there that the benchmark does not follow fails here, not in a
`bench/run_all.py` run that reports an error where the peers ratio should be."""

from __future__ import annotations

import json
import pstats
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.store import aio
from support.verifier_helpers import REPO

sys.path.insert(0, str(Path(REPO) / "bench"))
import fio_limit  # bench/fio_limit.py: the message the bench reports where fio is not installed


def test_kvtier_reads_back_what_it_wrote_and_its_layout_read_runs(tmp_path: Path) -> None:
    # (no fio: it reserves the host's hugetlb pages, which tests on other workers reserve and give back)
    prof = tmp_path / "prof"
    args = ("--stores", "kvtier", "--tokens", "512", "--repeat", "1", "--no-fio", "--cprofile", str(prof))
    args += ("--dir", str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "bench/peers.py", *args], capture_output=True, text=True, timeout=180, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    kvtier = json.loads(proc.stdout)["stores"]["kvtier"]
    assert "error" not in kvtier, kvtier.get("error")
    assert kvtier["read_back_correct"] is True and kvtier["cold_read_MBps"] > 0
    assert kvtier["restart"]["finds_its_data"] is True
    assert json.loads(proc.stdout)["raw_device"]["fio"] == {"missing": "left out (--no-fio)"}
    # the profile is of the timed cold reads: kvtier's load path, and the CPU they took is reported
    assert kvtier["cold_read_cpu_s"] > 0
    profiled = {f"{Path(file).name}:{name}" for file, _, name in pstats.Stats(str(prof / "kvtier-0.prof")).stats}
    assert "store.py:load_into" in profiled, sorted(profiled)[:20]
    ctx = aio.acquire()
    if ctx is not None and kvtier["io_backend"] == "odirect":  # the layout read goes through native AIO
        aio.release(ctx)
        assert kvtier["layout_read_MBps"] > 0


PEERS_PYTHON = Path(REPO) / "bench" / ".venv-peers" / "bin" / "python"


@pytest.mark.alone  # fio's buffers: vm.nr_hugepages is the host's, and tests on other workers reserve pages too
@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="no peers venv: bench/run_all.py --only peers creates it")
def test_lmcache_reads_every_object_with_o_direct_beside_the_disks_limit(tmp_path: Path) -> None:
    # LMCache takes O_DIRECT only for buffers a whole number of blocks long: the bench pads its objects, and counts
    # in LMCache's own read path that every cold read opened its file with O_DIRECT. The disk's limit (fio at
    # kvtier's request size and depth) is read in the same run, so the ratio to LMCache has both figures beside it.
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
    fio = out["raw_device"]["fio"]
    if shutil.which("fio") is None:
        assert fio == {"missing": fio_limit.INSTALL}
    else:
        assert "failed_rounds" not in fio, fio
        assert out["raw_device"]["fio_MBps"] > 0 and fio["iodepth"] >= 1, fio
        assert lm["cold_read_of_fio"] > 0 and out["stores"]["kvtier"]["cold_read_of_fio"] > 0
        assert out["kvtier_over_peer"]["lmcache"]["cold_read_MBps"] > 0
