"""The contract between the daemon and the verifier process it supervises, neither importing the other.

The daemon starts the verifier by command (`kvtier verifier run`) with `kvtier.core.parent.PARENT_PID_ENV` set, so
the child ends when the daemon dies. The verifier publishes its progress as a JSON document of the store's
(`meta_doc("verifier")`: a file it replaces whole, no index commit); the daemon, `kvtier status` and the verifier's
own CLI read it through
`verifier_status`, whose keys stay clear of the daemon's supervisor state (`state`, `pid`, `restarts`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

VERIFIER_DOC = "verifier"
STALE_AFTER_S = 30.0  # a heartbeat older than this means the verifier is not running


class MetaDocs(Protocol):
    """What the status is read from: a store's published documents (`kvtier.store.DiskStore.meta_doc`)."""

    def meta_doc(self, name: str) -> dict[str, Any] | None: ...


def verifier_status(store: MetaDocs) -> dict[str, Any]:
    """What the verifier last published: phase, readiness, heartbeat age, sweep progress, cumulative actions, its
    rates (`settings`) and whether it last paced at the busy rate because others were using the disk (`paced_busy`).

    `running` is true when the heartbeat is fresh and its pid exists (on this host).
    """
    doc = store.meta_doc(VERIFIER_DOC)
    if doc is None:
        return {
            "phase": "never ran",
            "running": False,
            "ready": False,
            "actions": {},
            "settings": {},
            "paced_busy": False,
        }
    age = max(0.0, time.time() - float(doc.get("heartbeat_at", 0.0)))
    alive = _pid_alive(int(doc.get("pid", 0)))
    return {
        "phase": doc.get("phase", "unknown"),
        "running": alive and age < STALE_AFTER_S and doc.get("phase") != "stopped",
        "ready": bool(doc.get("ready", False)) and alive and age < STALE_AFTER_S,
        "verifier_pid": doc.get("pid"),
        "heartbeat_age_s": round(age, 3),
        "sweep": doc.get("sweep", {}),
        "actions": dict(doc.get("actions", {})),
        "settings": dict(doc.get("settings", {})),
        "paced_busy": bool(doc.get("paced_busy", False)),
    }


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another uid
        return True
    return True
