"""SIGTERM ends a verifier within a bound whatever its daemon does (issue 43): beside a daemon whose applier
holds its lock but answers nothing (its thread gone or stuck), with both CPUs busy at normal priority, a verifier
waiting for a decision's reply stops waiting, sends nothing more, and exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvtier.core import CacheForm
from kvtier.store.channel import STOP_GRACE_S, applier_pid, spool_dir
from support.verifier_helpers import VK, populate, start_verifier, stop, wait_for

# The grace a stopping verifier gives a reply, then its exit at nice 19 beside two CPU hogs and whatever else
# the machine runs. The fault this catches waited out the channel's 30 s reply timeout, twice (a request's and
# the last status's), and a SCHED_IDLE verifier then got almost no CPU to exit with.
EXIT_BOUND_S = STOP_GRACE_S + 13.0
HOG = "while True: pass"
HOLD = (
    "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_EX); "
    "print('held', flush=True); sys.stdin.read()"
)


def test_sigterm_ends_a_verifier_whose_daemon_applies_nothing_beside_busy_cpus(tmp_path) -> None:
    root = str(tmp_path / "store")
    populate(root, [(VK, f"r{i}", CacheForm.COMPRESSED, 5000) for i in range(8)])
    os.makedirs(spool_dir(root), exist_ok=True)
    lock = os.path.join(spool_dir(root), "applier.lock")
    # the daemon's part: its applier lock held, its decisions never answered
    holder = subprocess.Popen([sys.executable, "-c", HOLD, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    hogs: list[subprocess.Popen[bytes]] = []
    proc = None
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        assert applier_pid(root) == holder.pid
        proc = start_verifier(root)

        def waiting_for_a_reply() -> bool:
            return any(n.startswith(f"{proc.pid}-") and n.endswith(".req") for n in os.listdir(spool_dir(root)))

        wait_for(waiting_for_a_reply, 120.0, proc, "the verifier sent a decision")
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the verifier was still running {EXIT_BOUND_S:g}s after SIGTERM") from None
        took = time.monotonic() - t0
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
        assert took < EXIT_BOUND_S
        # it took its requests back and sent nothing after the stop
        assert not [n for n in os.listdir(spool_dir(root)) if n.startswith(f"{proc.pid}-")]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        if proc is not None and proc.poll() is None:
            stop(proc, signal.SIGKILL)
        holder.kill()
        holder.wait()
