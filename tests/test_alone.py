"""The `alone` mark (tests/support/alone.py) under pytest-xdist: while a marked test runs, no other test is in
flight on any worker. An inner run on 3 workers: each ordinary test keeps a file in a shared folder while it
runs; each `alone` test checks, at its start and throughout a few hundred milliseconds, that the folder is empty."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

INNER = """
import os, time, pytest
D = os.environ["ALONE_DIR"]

@pytest.mark.parametrize("i", range(60))
def test_ordinary(i):
    mine = os.path.join(D, f"{os.getpid()}-{i}")
    open(mine, "w").close()
    time.sleep(0.01)  # work that takes a while, so tests on other workers would overlap it
    os.unlink(mine)

@pytest.mark.alone
@pytest.mark.parametrize("i", range(4))
def test_alone(i):
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        assert os.listdir(D) == [], "a test ran beside an alone test"
"""


def test_alone_tests_run_with_nothing_else_in_flight(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    running = tmp_path / "running"
    running.mkdir()
    tests = Path(__file__).parent
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3", "-p", "support.alone",
         f"--rootdir={tmp_path}", "-c", "/dev/null", str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tests), "ALONE_DIR": str(running)},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "64 passed" in res.stdout
