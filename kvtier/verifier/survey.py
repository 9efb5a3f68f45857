"""What is in segments/ against the `seg` table: sizes, missing files, uncommitted tails and stray files."""

from __future__ import annotations

import dataclasses
import os
import time

from kvtier.store import DiskStore, SegmentEntry, parse_segment_name

_PROBE_PREFIX = ".odirect-probe-"  # the store's O_DIRECT probe: `.odirect-probe-<pid>-<tid>`, removed by its process


@dataclasses.dataclass(frozen=True, slots=True)
class StrayFile:
    """A file in segments/ that no `seg` entry names."""

    name: str
    size: int
    mtime: float


@dataclasses.dataclass(slots=True)
class SegmentSurvey:
    """One look at segments/ (listed before the index was read, so a new segment cannot look stray)."""

    files: dict[int, tuple[int, float]]  # segment id -> (size, mtime) of files that have a `seg` entry
    entries: dict[int, SegmentEntry]
    strays: list[StrayFile]
    taken_at: float
    grace_s: float

    @property
    def missing(self) -> list[int]:
        """Segments the index names whose file is gone."""
        return sorted(s for s in self.entries if s not in self.files)

    def orphan_tail(self, seg_id: int) -> int:
        """Bytes past the committed tail of a sealed segment nobody has touched for the grace period."""
        entry, found = self.entries.get(seg_id), self.files.get(seg_id)
        if entry is None or found is None or not entry.sealed or self.taken_at - found[1] < self.grace_s:
            return 0
        return max(0, found[0] - entry.tail)

    def old_strays(self) -> list[StrayFile]:
        return [s for s in self.strays if self.taken_at - s.mtime >= self.grace_s]

    @property
    def orphaned_bytes(self) -> int:
        """Bytes on disk nothing references: uncommitted tails and stray files, older than the grace period."""
        return sum(self.orphan_tail(s) for s in self.files) + sum(s.size for s in self.old_strays())


def survey_segments(store: DiskStore, grace_s: float) -> SegmentSurvey:
    seg_dir = store.segment_dir
    listed: list[tuple[str, int | None, int, float]] = []
    with os.scandir(seg_dir) as it:
        for d in it:
            try:
                if not d.is_file(follow_symlinks=False):
                    continue
                st = d.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if d.name.startswith(_PROBE_PREFIX) and _probe_owner_alive(d.name):
                continue
            listed.append((d.name, parse_segment_name(d.name), st.st_size, st.st_mtime))
    entries = store.segments()
    files: dict[int, tuple[int, float]] = {}
    strays: list[StrayFile] = []
    for name, seg_id, size, mtime in listed:
        if seg_id is not None and seg_id in entries:
            files[seg_id] = (size, mtime)
        else:
            strays.append(StrayFile(name, size, mtime))
    return SegmentSurvey(files, entries, strays, time.time(), grace_s)


def _probe_owner_alive(name: str) -> bool:
    try:
        pid = int(name[len(_PROBE_PREFIX) :].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
