"""A process started with `tied_env` ends when its starter dies, however the starter dies (`kvtier.core.parent`).

Real processes: a starter that starts a child from its main thread and is then SIGKILLed (no clean-up of its
runs), a child whose named starter is gone before it asks, a child the kernel refuses the prctl (the poll takes
over), and one started without the variable (nothing changes). The child's SIGTERM handler writes what it
heard to a file, so the test reads the signal itself, not the child's absence alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.core.parent import PARENT_PID_ENV, PARENT_POLL_S
from support.daemon import child_env
from support.procs import ended

# The child: SIGTERM's handler records it and exits; then it ties itself to its starter and says so.
CHILD = """
import ctypes, os, signal, sys, time
out = sys.argv[1]
def heard(signum, frame):
    open(out, "w").write(f"{{signum}}")
    os._exit(0)
signal.signal(signal.SIGTERM, heard)
if {refuse}:  # as a kernel that refuses PR_SET_PDEATHSIG would
    class NoPrctl:
        def prctl(self, *args):
            return -1
    ctypes.CDLL = lambda *a, **k: NoPrctl()
from kvtier.core.parent import end_with_parent
end_with_parent(signal.SIGTERM)
print("tied", flush=True)
while True:
    time.sleep(3600)
"""
# The starter: starts the child with its own pid in the child's environment, says the child's pid, waits.
STARTER = """
import os, subprocess, sys
from kvtier.core.parent import tied_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=tied_env(os.environ),
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "tied\\n"
print(child.pid, flush=True)
sys.stdin.read()
"""


def _wait_heard(out: Path, pid: int, limit_s: float) -> str:
    """What the child recorded once it has ended (polling real conditions: the file and the pid)."""
    deadline = time.monotonic() + limit_s
    while not out.exists() or not ended(pid):
        assert time.monotonic() < deadline, f"child {pid} still running {limit_s:.0f} s after its starter died"
        time.sleep(0.02)
    return out.read_text()


def _kill_the_starter(tmp_path: Path, refuse: bool) -> tuple[int, Path]:
    out = tmp_path / "heard"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, CHILD.format(refuse=refuse), str(out)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout is not None
    child = int(starter.stdout.readline())
    assert not ended(child) and not out.exists()
    starter.kill()
    starter.wait(10)
    return child, out


def test_the_child_hears_its_signal_when_its_starter_is_killed(tmp_path: Path) -> None:
    child, out = _kill_the_starter(tmp_path, refuse=False)
    assert _wait_heard(out, child, 10) == str(int(signal.SIGTERM))


def test_where_the_kernel_refuses_the_prctl_the_poll_sends_it(tmp_path: Path) -> None:
    child, out = _kill_the_starter(tmp_path, refuse=True)
    assert _wait_heard(out, child, 10 + 2 * PARENT_POLL_S) == str(int(signal.SIGTERM))


def test_a_starter_gone_before_the_child_asks_is_found_at_once(tmp_path: Path) -> None:
    # the child's parent is this test; the variable names another process, as after the starter died and the
    # child was given to init between its fork and its call
    out = tmp_path / "heard"
    other = os.getppid()
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(refuse=False), str(out)],
        env=child_env(**{PARENT_PID_ENV: str(other)}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0 and "tied" not in child.stdout, child.stderr
    assert out.read_text() == str(int(signal.SIGTERM))


@pytest.mark.parametrize("value", [None, "not-a-pid"], ids=["unset", "not-a-pid"])
def test_without_a_pid_in_the_variable_nothing_changes(tmp_path: Path, value: str | None) -> None:
    out = tmp_path / "heard"
    env = child_env()
    env.pop(PARENT_PID_ENV, None)
    if value is not None:
        env[PARENT_PID_ENV] = value
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(refuse=False), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "tied\n"
        assert child.poll() is None and not out.exists()
    finally:
        child.kill()
        _, err = child.communicate()
    assert ("not a process id" in err) == (value is not None), err
