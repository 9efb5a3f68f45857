"""bench/gds_restore.py, issue 14's GDS benchmark, run here on the host (`--device cpu`): its scenario writes,
restores cold through the store into pool memory and compares every byte, so the script a device session runs on
CUDA is known to work before that session spends device time on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.verifier_helpers import REPO


def _run(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "bench/gds_restore.py", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_scenario_restores_every_byte_and_reports_against_the_disk(tmp_path: Path) -> None:
    args = ("--device", "cpu", "--objects", "6", "--size", str(1 << 20), "--batch", "4", "--rounds", "2")
    out = _run(*args, "--dir", str(tmp_path))
    assert out["bytes_equal"] is True
    assert (out["objects"], out["bytes"]) == (6, 6 << 20)
    assert out["io_backend"] in ("odirect", "buffered") and out["kvikio_compat_mode"] is None
    assert out["h2d_GBps"] is None and out["restore_of_h2d"] is None  # no device: no host-to-device figure
    assert len(out["round_GBps"]) == 2 and out["restore_GBps"] == max(out["round_GBps"]) > 0
    if out["io_backend"] == "odirect":
        assert out["disk_GBps"] > 0 and out["restore_of_disk"] == pytest.approx(
            out["restore_GBps"] / out["disk_GBps"], rel=0.01
        )
    assert not any(tmp_path.iterdir())  # its store is gone


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the script would run the GDS path")
def test_without_cuda_the_device_run_says_it_skipped() -> None:
    assert "skipped" in _run("--device", "cuda")
