"""Lower the verifier's CPU and I/O priority (best effort): SCHED_BATCH at nice 19, then the idle I/O class, on
every thread of the process.

Why SCHED_BATCH at nice 19 and not SCHED_IDLE: the verifier holds no lock the daemon waits on (its index changes
go to the daemon's applier as decisions), so nothing is gained by starving it, and on an inference node whose
CPUs are saturated at normal priority a SCHED_IDLE verifier got too little CPU to ever finish a maintenance pass:
the store was never evicted or compacted, and its exit on SIGTERM took minutes. Nice 19 is the smallest weight a
normal policy has (15 against a nice-0 task's 1024, five times SCHED_IDLE's 3): a bounded share of a busy CPU that
keeps eviction and compaction moving. SCHED_BATCH on top of it never preempts a running task
when the verifier wakes, so a reader thread that is running keeps its CPU; a reader that wakes while the verifier
runs preempts it once the verifier's short protected slice is over.

An unprivileged process cannot leave SCHED_IDLE once in it (unless RLIMIT_NICE allows nice 19): a process
started SCHED_IDLE (a unit's CPUSchedulingPolicy=idle) raises its soft RLIMIT_NICE as far as the hard limit
lets it and tries; where it cannot, it stays SCHED_IDLE and says so.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import resource
import shutil
import subprocess

log = logging.getLogger(__name__)

IOPRIO_WHO_PROCESS = 1  # with a thread id: that one thread
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 283, "riscv64": 30}
VERIFIER_NICE = 19


def lower_priority(nice: int = VERIFIER_NICE) -> dict[str, object]:
    """Raise niceness to at least `nice`, take SCHED_BATCH and ask for the idle I/O class, for every thread the
    process has now (all three are per thread on Linux, and some library threads exist before this is called);
    threads started later inherit them. Returns what was achieved on all of them: `policy` is "batch", "idle" (a
    SCHED_IDLE it could not leave) or "unchanged"."""
    tids = _threads()
    niceness = min(_renice(t, nice) for t in tids)  # first: leaving SCHED_IDLE is judged at the nice it will have
    policies = {_sched_batch(t) for t in tids}
    policy = "batch" if policies == {"batch"} else "idle" if "idle" in policies else "unchanged"
    ionice = all([_ioprio_idle(t) for t in tids])
    return {"policy": policy, "nice": niceness, "ionice": "idle" if ionice else "unchanged"}


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only
        return [0]


def _sched_batch(tid: int) -> str:
    """The policy the thread has now: "batch", or "idle" (a SCHED_IDLE it could not leave), or "unchanged"."""
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        return "batch"
    except ProcessLookupError:  # the thread exited meanwhile: nothing left to change
        return "batch"
    except PermissionError:
        if _allow_nice(os.getpriority(os.PRIO_PROCESS, tid)):
            try:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                return "batch"
            except OSError as exc:
                log.info("cannot take SCHED_BATCH for thread %d: %s", tid, exc)
        else:
            log.warning("thread %d cannot leave SCHED_IDLE (RLIMIT_NICE's hard limit): it may starve", tid)
    except (OSError, AttributeError) as exc:  # AttributeError: a platform without SCHED_BATCH
        log.info("cannot take SCHED_BATCH for thread %d: %s", tid, exc)
    return _current_policy(tid)


def _allow_nice(nice: int) -> bool:
    """Raise the soft RLIMIT_NICE so that `nice` is within it (the kernel's ceiling is 20 - limit); False if the
    hard limit does not allow it."""
    need = 20 - nice
    soft, hard = resource.getrlimit(resource.RLIMIT_NICE)
    if soft >= need:
        return True
    if hard != resource.RLIM_INFINITY and hard < need:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NICE, (need, hard))
    except (OSError, ValueError):
        return False
    return True


def _current_policy(tid: int) -> str:
    try:
        return "idle" if os.sched_getscheduler(tid) == os.SCHED_IDLE else "unchanged"
    except OSError:
        return "unchanged"


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
