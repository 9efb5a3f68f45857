"""Lower the verifier's CPU and I/O priority (best effort): the idle scheduling policy and nice, then the idle I/O
class, on every thread of the process."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess

log = logging.getLogger(__name__)

IOPRIO_WHO_PROCESS = 1  # with a thread id: that one thread
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 283, "riscv64": 30}


def lower_priority(nice: int = 19) -> dict[str, object]:
    """Take the SCHED_IDLE policy, raise niceness to at least `nice` and ask for the idle I/O class, for every
    thread the process has now (all three are per thread on Linux, and some library threads exist before this is
    called); threads started later inherit them. Returns what was achieved on all of them.

    SCHED_IDLE rather than nice alone: a nice-19 task the scheduler has picked keeps its CPU for its slice (a
    millisecond or more) when a reader thread wakes, which lands in the readers' p99 on a machine with few cores;
    a waking normal task preempts a SCHED_IDLE one at once.
    """
    tids = _threads()
    policy = all([_sched_idle(t) for t in tids])
    niceness = min(_renice(t, nice) for t in tids)
    ionice = all([_ioprio_idle(t) for t in tids])
    return {"policy": "idle" if policy else "unchanged", "nice": niceness, "ionice": "idle" if ionice else "unchanged"}


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only
        return [0]


def _sched_idle(tid: int) -> bool:
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except ProcessLookupError:  # the thread exited meanwhile: nothing left to lower
        pass
    except (OSError, AttributeError) as exc:  # AttributeError: a platform without SCHED_IDLE
        log.info("cannot take SCHED_IDLE for thread %d: %s", tid, exc)
        return False
    return True


def _renice(tid: int, nice: int) -> int:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return nice
    except OSError as exc:
        log.warning("cannot lower CPU priority of thread %d: %s", tid, exc)
        return os.getpriority(os.PRIO_PROCESS, 0)


def _ioprio_idle(tid: int) -> bool:
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syscall(nr, IOPRIO_WHO_PROCESS, tid, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT) == 0:
                return True
            log.info("ioprio_set failed: %s", os.strerror(ctypes.get_errno()))
        except (OSError, AttributeError) as exc:
            log.info("ioprio_set unavailable: %s", exc)
    tool = shutil.which("ionice")
    if tool is None:
        return False
    return subprocess.run([tool, "-c", "3", "-p", str(tid or os.getpid())], capture_output=True).returncode == 0
