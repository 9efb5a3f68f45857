"""The verifier's progress and counters, kept in the index (`meta` doc `verifier`) so a restart resumes.

The daemon reads the same document for `kvtier status` and metrics through `kvtier.core.verifier_status`, which
defines its name and how it is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtier.core.tier import ObjectKey
from kvtier.store import decode_key, encode_key


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
