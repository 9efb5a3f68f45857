"""Lower the verifier's CPU and I/O priority (best effort): the idle scheduling policy and nice, then the idle I/O
class."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess

log = logging.getLogger(__name__)

IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 283, "riscv64": 30}


def lower_priority(nice: int = 19) -> dict[str, object]:
    """Take the SCHED_IDLE policy, raise niceness to at least `nice` and ask for the idle I/O class; returns what
    was achieved.

    SCHED_IDLE rather than nice alone: a nice-19 task the scheduler has picked keeps its CPU for its slice (about
    a millisecond or more) when a reader thread wakes, which lands in the readers' p99 on a machine with few
    cores; a waking normal task preempts a SCHED_IDLE one at once. Call before starting threads: the policy and
    the I/O class are per task and only threads started later inherit them.
    """
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current < nice:
        try:
            current = os.nice(nice - current)
        except OSError as exc:
            log.warning("cannot lower CPU priority: %s", exc)
    return {"policy": _sched_idle(), "nice": current, "ionice": "idle" if _ioprio_idle() else "unchanged"}


def _sched_idle() -> str:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    except (OSError, AttributeError) as exc:  # AttributeError: a platform without SCHED_IDLE
        log.info("cannot take SCHED_IDLE: %s", exc)
        return "unchanged"


def _ioprio_idle() -> bool:
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syscall(nr, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT) == 0:
                return True
            log.info("ioprio_set failed: %s", os.strerror(ctypes.get_errno()))
        except (OSError, AttributeError) as exc:
            log.info("ioprio_set unavailable: %s", exc)
    tool = shutil.which("ionice")
    if tool is None:
        return False
    return subprocess.run([tool, "-c", "3", "-p", str(os.getpid())], capture_output=True).returncode == 0
