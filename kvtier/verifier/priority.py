"""Lower the verifier's CPU and I/O priority (best effort): nice, then the idle I/O class."""

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
    """Raise niceness to at least `nice` and ask for the idle I/O class; returns what was achieved.

    Call before starting threads: the I/O class is per task and only threads started later inherit it.
    """
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current < nice:
        try:
            current = os.nice(nice - current)
        except OSError as exc:
            log.warning("cannot lower CPU priority: %s", exc)
    return {"nice": current, "ionice": "idle" if _ioprio_idle() else "unchanged"}


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
