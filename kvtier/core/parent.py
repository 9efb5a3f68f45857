"""A kvtier process started by another one ends when its starter does, however the starter dies.

Contract:
- The starter puts its pid in the child's environment as `PARENT_PID_ENV` (`tied_env`), and starts the child from
  a thread that lives as long as it does (the kernel's death signal follows the thread that forked, not the
  process).
- The child calls `end_with_parent(signum)` once its handler for `signum` is in place. From then on the kernel
  sends it `signum` when the starter dies (prctl PR_SET_PDEATHSIG, kept across exec). A starter that died
  between its fork and that call is found at once (getppid() is no longer it) and the signal is sent then.
  Where the kernel refuses the prctl (or has none), a thread polls getppid() every PARENT_POLL_S and sends it.
- Without `PARENT_PID_ENV` nothing changes: the daemon under systemd, anything a user starts from a shell. A value
  that is not a process id is logged and ignored.

Who: the daemon's supervisor starts the verifier so (SIGKILL: a verifier stuck in a lock wait answers nothing
else, and the store is crash-safe); `kvtier demo` and the benchmarks start `kvtier serve` so (SIGTERM: it drains,
removes its socket and exits 0). Why: a starter killed with SIGKILL (an OOM kill, a test runner's or a benchmark
driver's timeout) runs no clean-up, and a daemon left behind keeps its socket, its pools' memory and its disk
work beside whatever runs next.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

PARENT_PID_ENV = "KVTIER_PARENT_PID"
PARENT_POLL_S = 1.0
_PR_SET_PDEATHSIG = 1


def tied_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child that is to end with this process (it calls `end_with_parent`)."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def end_with_parent(signum: int) -> None:
    """Have `signum` sent to this process when the starter named in `PARENT_PID_ENV` dies (no-op without it)."""
    named = os.environ.get(PARENT_PID_ENV, "")
    if not named:
        return
    if not named.isdigit():  # (set by hand: kvtier writes a pid) not a reason to refuse to start
        log.warning("ignoring %s=%r: not a process id", PARENT_PID_ENV, named)
        return
    parent = int(named)
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # (Linux's; elsewhere the poll does)
    refused = prctl is None or prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0
    if refused:
        log.warning("no prctl(PR_SET_PDEATHSIG) here (errno %d): polling the parent instead", ctypes.get_errno())
    if os.getppid() != parent:
        log.info("the process that started this one (pid %d) is gone; ending", parent)
        os.kill(os.getpid(), signum)
        return
    if refused:
        threading.Thread(target=_watch, args=(parent, signum), name="kvtier-parent-watch", daemon=True).start()


def _watch(parent: int, signum: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)  # a poll of the parent pid: nothing to wait on instead
    log.error("the process that started this one (pid %d) is gone; ending", parent)
    os.kill(os.getpid(), signum)
