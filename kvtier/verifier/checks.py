"""Per-record checks from the index alone (namespace live, segment present and long enough, layout digest)."""

from __future__ import annotations

import dataclasses
import enum
import os
import time

from kvtier.store import DiskStore, NamespaceEntry, QuarantineReason, RecordInfo, RecordState, segment_name
from kvtier.verifier.layouts import LayoutOracle


class Verdict(enum.Enum):
    SERVING = "serving"  # live record of a live namespace, nothing wrong seen from the index
    STALE = "stale"  # its namespace is retired (or no longer registered): a miss, to be dropped
    QUARANTINED = "quarantined"  # already taken out of service
    CORRUPT = "corrupt"  # a fault was found that is not yet quarantined


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    verdict: Verdict
    fault: QuarantineReason | None = None


SERVING = Finding(Verdict.SERVING)
STALE = Finding(Verdict.STALE)
QUARANTINED = Finding(Verdict.QUARANTINED)


class SegmentFiles:
    """Segment file sizes, stat'ed lazily; a miss or a short file is re-stat'ed before anything is concluded.

    Index rows are read before the stat, and a record's bytes are fsynced before its row commits, so a fresh
    stat that finds the file missing or shorter than the record is a real fault, not a race with the writer.
    """

    def __init__(self, seg_dir: str) -> None:
        self._seg_dir = seg_dir
        self._sizes: dict[int, int | None] = {}

    def size(self, seg_id: int, need: int = 0) -> int | None:
        size = self._sizes.get(seg_id)
        if size is None or size < need:
            size = self._sizes[seg_id] = self._stat(seg_id)
        return size

    def _stat(self, seg_id: int) -> int | None:
        try:
            return os.stat(os.path.join(self._seg_dir, segment_name(seg_id))).st_size
        except FileNotFoundError:
            return None


class NamespaceView:
    """The namespace table, re-read when a record names a namespace it has not seen since that record was read."""

    def __init__(self, store: DiskStore) -> None:
        self._store = store
        self._entries: dict[bytes, NamespaceEntry] = {}
        self._read_at = 0.0
        self.refresh()

    def refresh(self) -> None:
        self._read_at = time.monotonic()
        self._entries = self._store.namespaces()

    def get(self, ns: bytes, seen_at: float) -> NamespaceEntry | None:
        """The entry of `ns`; `seen_at` is when the caller read the row naming it (monotonic clock)."""
        if ns not in self._entries and self._read_at < seen_at:
            self.refresh()
        return self._entries.get(ns)

    @property
    def entries(self) -> dict[bytes, NamespaceEntry]:
        return self._entries


def classify(
    info: RecordInfo, seen_at: float, namespaces: NamespaceView, files: SegmentFiles, oracle: LayoutOracle
) -> Finding:
    """What the index says about one record (no payload read; `DiskStore.verify_many` does the deep check)."""
    e = info.entry
    if e is None:
        return Finding(Verdict.CORRUPT, QuarantineReason.INDEX_VALUE)
    if e.state is RecordState.QUARANTINED:
        return QUARANTINED
    ns = namespaces.get(info.key.namespace, seen_at)
    if ns is None or not ns.live:
        return STALE
    end = e.offset + e.record_len
    size = files.size(e.segment, end)
    if size is None:
        return Finding(Verdict.CORRUPT, QuarantineReason.SEGMENT_MISSING)
    if size < end:
        return Finding(Verdict.CORRUPT, QuarantineReason.SEGMENT_TRUNCATED)
    expected = oracle.expected(ns.version_key, info.key.group)
    if expected is not None and expected != e.layout_digest:
        return Finding(Verdict.CORRUPT, QuarantineReason.LAYOUT)
    return SERVING
