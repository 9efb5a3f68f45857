"""Per-record checks from the index alone (namespace live, segment present and long enough, layout digest), applied
to a page of the index as columns (`classify_page`): the inventory of every maintenance pass walks every row, so the
rules are looked up once per namespace, group and segment, not once per record."""

from __future__ import annotations

import dataclasses
import enum
import os
import time

import numpy as np

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.store import (
    DiskStore,
    IndexPage,
    NamespaceEntry,
    QuarantineReason,
    RecordState,
    segment_name,
)
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


VERDICTS = (Verdict.SERVING, Verdict.STALE, Verdict.QUARANTINED, Verdict.CORRUPT)  # PageVerdicts.verdict's codes
SERVING_CODE, STALE_CODE, QUARANTINED_CODE, CORRUPT_CODE = range(len(VERDICTS))


@dataclasses.dataclass(slots=True)
class PageVerdicts:
    """`classify_page`'s answer: per row of the page a code into VERDICTS, and each CORRUPT row's fault; per row the
    number of its (namespace, form) in `forms`, which `counts` the inventory adds up by."""

    verdict: np.ndarray  # uint8 per row
    faults: dict[int, QuarantineReason]  # row -> why, for every CORRUPT row
    form_of: np.ndarray  # int64 per row: its (namespace, form) in `forms`
    forms: list[tuple[bytes, CacheForm]]

    def keyed_faults(self, page: IndexPage) -> list[tuple[ObjectKey, QuarantineReason]]:
        """The CORRUPT rows of `page` as (key, why), in row order."""
        rows = sorted(self.faults)
        return list(zip(page.keys_at(rows), [self.faults[i] for i in rows]))

    def demote(self, row: int, fault: QuarantineReason) -> None:
        """A row found corrupt later (its payload re-read)."""
        self.verdict[row] = CORRUPT_CODE
        self.faults[row] = fault


def classify_page(
    page: IndexPage, seen_at: float, namespaces: NamespaceView, files: SegmentFiles, oracle: LayoutOracle
) -> PageVerdicts:
    """The rules for every row of `page` at once (read at `seen_at`), in their order: a value that does not parse
    is corrupt (`index_value`); then a quarantined record is quarantined; then one of a namespace not registered or
    retired is stale; then one whose segment is missing or shorter than the record, or whose layout digest is not
    the one its namespace's version key implies, is corrupt; any other is serving. The namespace, layout and segment
    are looked up once per group (`IndexPage.groups`) and segment, and applied to the columns."""
    e, group_of = page.entries, page.group_of
    live = np.zeros(len(page.groups), bool)
    has_digest = np.zeros(len(page.groups), bool)
    digests = np.zeros(len(page.groups), "V16")
    form_ids: dict[tuple[bytes, CacheForm], int] = {}
    form_of_group = np.zeros(len(page.groups), np.int64)
    for g, key in enumerate(page.groups):
        form_of_group[g] = form_ids.setdefault((key.namespace, key.form), len(form_ids))
        ns = namespaces.get(key.namespace, seen_at)
        live[g] = ns is not None and ns.live
        expected = oracle.expected(ns.version_key, key.group) if ns is not None and ns.live else None
        if expected is not None:
            has_digest[g], digests[g] = True, np.frombuffer(expected, "V16")[0]
    verdict = np.full(len(page), SERVING_CODE, np.uint8)
    faults = {i: QuarantineReason.INDEX_VALUE for i in np.flatnonzero(~page.parsed).tolist()}
    quarantined = page.parsed & (e["state"] == RecordState.QUARANTINED)
    stale = page.parsed & ~quarantined & ~live[group_of]
    checked = np.flatnonzero(page.parsed & ~quarantined & live[group_of])
    if len(checked):
        segs, ends = e["segment"][checked], e["offset"][checked] + e["record_len"][checked]
        uniq, at = np.unique(segs, return_inverse=True)
        need = np.zeros(len(uniq), np.uint64)
        np.maximum.at(need, at, ends)
        sizes = [files.size(int(s), int(n)) for s, n in zip(uniq.tolist(), need.tolist())]
        missing = np.array([z is None for z in sizes], bool)[at]
        truncated = ~missing & (np.array([z or 0 for z in sizes], np.uint64)[at] < ends)
        groups = group_of[checked]
        layout = ~missing & ~truncated & has_digest[groups] & (e["layout_digest"][checked] != digests[groups])
        for mask, why in (
            (missing, QuarantineReason.SEGMENT_MISSING),
            (truncated, QuarantineReason.SEGMENT_TRUNCATED),
            (layout, QuarantineReason.LAYOUT),
        ):
            faults.update(dict.fromkeys(checked[mask].tolist(), why))
    verdict[stale] = STALE_CODE
    verdict[quarantined] = QUARANTINED_CODE
    verdict[list(faults)] = CORRUPT_CODE
    return PageVerdicts(verdict, faults, form_of_group[group_of], list(form_ids))
