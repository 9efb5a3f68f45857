"""The verifier's progress and counters, kept in the index (`meta` doc `verifier`) so a restart resumes.

The daemon reads the same document for `kvtier status` and metrics: `verifier_status(store)`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore, decode_key, encode_key

DOC = "verifier"
STALE_AFTER_S = 30.0  # a heartbeat older than this means the verifier is not running


@dataclasses.dataclass(slots=True)
class SweepProgress:
    """Where the rate-limited full sweep is: resumed from `cursor` after a restart."""

    in_progress: bool = False
    cursor: ObjectKey | None = None
    started_at: float = 0.0
    last_completed_at: float = 0.0
    records: int = 0
    bytes: int = 0

    def to_doc(self) -> dict[str, Any]:
        return {
            "in_progress": self.in_progress,
            "cursor": encode_key(self.cursor).hex() if self.cursor else None,
            "started_at": self.started_at,
            "last_completed_at": self.last_completed_at,
            "records": self.records,
            "bytes": self.bytes,
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> SweepProgress:
        cursor = doc.get("cursor")
        return cls(
            bool(doc.get("in_progress", False)),
            decode_key(bytes.fromhex(cursor)) if cursor else None,
            float(doc.get("started_at", 0.0)),
            float(doc.get("last_completed_at", 0.0)),
            int(doc.get("records", 0)),
            int(doc.get("bytes", 0)),
        )


def verifier_status(store: DiskStore) -> dict[str, Any]:
    """What the verifier last published: phase, readiness, heartbeat age, sweep progress and cumulative actions.

    `running` is true when the heartbeat is fresh and its pid exists (on this host). Keys do not clash with the
    daemon's supervisor state (`state`, `pid`, `restarts`), which the daemon lays over this.
    """
    doc = store.meta_doc(DOC)
    if doc is None:
        return {"phase": "never ran", "running": False, "ready": False, "actions": {}}
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
    }


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
