"""The cleaner's actions on one inventory: quarantine, retire, drop expired quarantines, evict (leaving tombstones,
pruned after their retention), reclaim, compact, unlink.

Every removal is a conditional drop (the record must still be what the inventory saw) in bounded write
transactions; bytes are unlinked only through `DiskStore.try_unlink_segment` (flock + reader epochs).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Iterator, Sequence

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.store import (
    DiskStore,
    DropIf,
    RecordState,
    StoreLimits,
    encode_key,
    parse_segment_name,
    unlink_in_steps,
)
from kvtier.verifier.checks import NamespaceView
from kvtier.verifier.inventory import Inventory
from kvtier.verifier.policy import Candidate, plan_eviction
from kvtier.verifier.settings import VerifierSettings
from kvtier.verifier.survey import SegmentSurvey
from kvtier.verifier.throttle import RateLimiter

log = logging.getLogger(__name__)

COMPACT_BYTES_PER_PASS = 256 << 20


class Cleaner:
    """Acts on what an inventory found; counts what it did in `actions` (cumulative, persisted by the verifier)."""

    def __init__(
        self, store: DiskStore, settings: VerifierSettings, limiter: RateLimiter, actions: collections.Counter[str]
    ) -> None:
        self.store = store
        self.settings = settings
        self.limiter = limiter
        self.actions = actions
        self._tombstone_cursor = b""  # where the next bounded tombstone scan resumes

    def limits(self) -> StoreLimits:
        return self.settings.limits or self.store.limits() or StoreLimits()

    def act(self, survey: SegmentSurvey, inv: Inventory, namespaces: NamespaceView) -> None:
        now = time.time()
        self.quarantine(inv.faults)
        self.retire(inv.stale, namespaces)
        remaining = self.drop_expired_quarantine(inv.candidates, now)
        self.evict(remaining, now)
        self.prune_tombstones(now)
        self.remove_strays(survey)
        self.trim_tails(survey)
        self.compact(survey, inv)
        self.unlink_empty()

    # -- records ------------------------------------------------------------------------------------

    def quarantine(self, faults: Sequence[tuple[ObjectKey, object]]) -> None:
        for key, why in faults:
            log.warning(
                "quarantining %s/%s/%s: %s",
                key.namespace.hex(),
                key.block_hash.hex(),
                key.group,
                getattr(why, "label", why),
            )
            if self.store.quarantine(key, why):  # type: ignore[arg-type]
                self.actions["quarantined"] += 1

    def retire(self, stale: Sequence[tuple[ObjectKey, int]], namespaces: NamespaceView) -> None:
        """Drop the records of retired (or unregistered) namespaces; re-reads the namespaces first (a rollback wins)."""
        if not stale:
            return
        namespaces.refresh()
        gone = [(k, seq) for k, seq in stale if (ns := namespaces.entries.get(k.namespace)) is None or not ns.live]
        self.actions["retired"] += self._drop([DropIf(encode_key(k), seq) for k, seq in gone])

    def drop_expired_quarantine(self, candidates: list[Candidate], now: float) -> list[Candidate]:
        """Drop quarantined records older than the retention; returns the candidates still indexed."""
        cutoff = now - self.settings.quarantine_retention_s
        expired = [c for c in candidates if c.quarantined and c.quarantined_at <= cutoff]
        if expired:
            quarantined = int(RecordState.QUARANTINED)
            self.actions["quarantine_dropped"] += self._drop(
                [DropIf(encode_key(c.key), c.seq, quarantined) for c in expired]
            )
        gone = {id(c) for c in expired}
        return [c for c in candidates if id(c) not in gone]

    def usage(self) -> dict[CacheForm, int]:
        """Record bytes per form, plus the room the daemon's blocked write-back asks for (the store's
        `write_back` document): counted as used, so a form whose writes wait is evicted below the usual
        watermark until they fit."""
        used = {CacheForm(f): int(u["record_bytes"]) for f, u in self.store.stats()["forms"].items()}
        asked = (self.store.meta_doc("write_back") or {}).get("room_bytes", {})
        for form, n in asked.items():
            used[CacheForm(form)] = used.get(CacheForm(form), 0) + int(n)
        return used

    def evict(self, candidates: list[Candidate], now: float) -> None:
        usage = self.usage()
        victims = plan_eviction(
            candidates, usage, self.limits(), now, high=self.settings.evict_high, low=self.settings.evict_low
        )
        if not victims:
            return
        for start in range(0, len(victims), self.settings.batch_records):
            batch = victims[start : start + self.settings.batch_records]
            dropped = self.store.drop_if([_evict_if(c, now) for c in batch], tombstone=True)
            self.actions["evicted"] += dropped
        log.info(
            "evicted up to %d records (%d bytes) to stay within %s",
            len(victims),
            sum(c.record_len for c in victims),
            self.limits(),
        )

    def prune_tombstones(self, now: float) -> None:
        """Forget evictions older than the retention: those keys read as missing again."""
        n, self._tombstone_cursor = self.store.prune_tombstones(
            now - self.settings.tombstone_retention_s, start=self._tombstone_cursor
        )
        if n:
            self.actions["tombstones_pruned"] += n

    def _drop(self, items: Sequence[DropIf]) -> int:
        """Drop in bounded batches (each one short write transaction, here or in the daemon)."""
        step = self.settings.batch_records
        return sum(self.store.drop_if(items[start : start + step]) for start in range(0, len(items), step))

    # -- bytes ----------------------------------------------------------------------------------------

    def remove_strays(self, survey: SegmentSurvey) -> None:
        strays = survey.old_strays()
        if not strays:
            return
        known = self.store.segments()
        seg_dir = self.store.segment_dir
        for s in strays:
            seg_id = parse_segment_name(s.name)
            if seg_id is not None and seg_id in known:
                continue
            if not unlink_in_steps(os.path.join(seg_dir, s.name)):
                continue
            log.info("removed stray file segments/%s (%d bytes)", s.name, s.size)
            self.actions["strays_removed"] += 1
            self.actions["stray_bytes"] += s.size

    def trim_tails(self, survey: SegmentSurvey) -> None:
        for seg_id in survey.files:
            if survey.orphan_tail(seg_id):
                self.actions["orphan_bytes_trimmed"] += self.store.trim_segment(seg_id)

    def compact(self, survey: SegmentSurvey, inv: Inventory) -> None:
        """Move the live records out of sealed segments that are mostly dead, emptiest first, rate-limited.

        The copies go in bursts that the limiter paces (a tenth of a second of the busy rate while the disk is
        busy); one relocation, a sync and a commit, takes up to `batch_records` records and `batch_bytes` bytes
        of bursts. A sync and a commit per burst were what the store's readers felt most of the verifier's writing
        (bench/verifier.py: the p99 of its writing windows)."""
        ranked = []
        for seg_id, (size, _) in survey.files.items():
            entry = survey.entries[seg_id]
            live = inv.serving_bytes.get(seg_id, 0)
            if entry.sealed and size and live and live / size < self.settings.compact_below:
                ranked.append((live / size, seg_id))
        if not ranked:
            return
        keys_by_seg: dict[int, list[Candidate]] = {}
        for c in inv.candidates:
            if not c.quarantined:
                keys_by_seg.setdefault(c.segment, []).append(c)
        work = _CompactionWork([(seg_id, keys_by_seg.get(seg_id, [])) for _, seg_id in sorted(ranked)])
        while work.more():
            moved = self.store.relocate(self._bursts(work))
            work.settle(moved)
            self.actions["relocated"] += sum(moved)
        self.actions["relocated_bytes"] += work.drawn_bytes
        self.actions["segments_compacted"] += work.compacted()

    def _bursts(self, work: _CompactionWork) -> Iterator[list[ObjectKey]]:
        """One relocation's bursts, each within one segment, each taken from the limiter before it is yielded."""
        records = size = 0
        while work.more() and records < self.settings.batch_records and size < self.settings.batch_bytes:
            limit = self.limiter.burst(self.settings.batch_bytes - size)
            burst, nbytes = work.draw(self.settings.batch_records - records, limit)
            if not self.limiter.take(2 * nbytes):  # read + write; False: the verifier is stopping
                work.stop()
                return
            work.commit_draw(burst, nbytes)
            records, size = records + len(burst), size + nbytes
            yield [c.key for c in burst]

    def unlink_empty(self) -> None:
        for seg_id, entry in self.store.segments().items():
            if entry.sealed and entry.referenced == 0 and self.store.try_unlink_segment(seg_id):
                log.info("unlinked segment %016x", seg_id)
                self.actions["segments_unlinked"] += 1


def _evict_if(c: Candidate, now: float) -> DropIf:
    """Evict the record the plan chose only if it is still that record in the state planned, and not pinned since
    (unless it was planned as a pinned victim)."""
    state = RecordState.QUARANTINED if c.quarantined else RecordState.LIVE
    return DropIf(encode_key(c.key), c.seq, int(state), pinned_ok=c.quarantined or c.pinned(now))


class _CompactionWork:
    """What one compaction pass has left to copy, segment by segment, within its byte budget; and, once
    relocations report back, which segments it emptied of every record it found there."""

    def __init__(self, segments: list[tuple[int, list[Candidate]]]) -> None:
        self._todo = [(seg_id, list(cands)) for seg_id, cands in segments]
        self._stopped = False
        self._drawn: list[tuple[int, int]] = []  # (segment, records) of each burst drawn since the last settle
        self._missed: set[int] = set()  # segments with a record that did not move
        self._done: list[int] = []  # segments drawn to the end
        self.drawn_bytes = 0

    def more(self) -> bool:
        while self._todo and not self._todo[0][1]:
            self._done.append(self._todo.pop(0)[0])
        return bool(self._todo) and self.drawn_bytes < COMPACT_BYTES_PER_PASS and not self._stopped

    def draw(self, max_records: int, limit: int) -> tuple[list[Candidate], int]:
        """The next burst of the first segment: at least one record, then more while under both bounds."""
        pending = self._todo[0][1]
        n, nbytes = 1, pending[0].record_len
        while n < min(max_records, len(pending)) and nbytes + pending[n].record_len <= limit:
            nbytes += pending[n].record_len
            n += 1
        return pending[:n], nbytes

    def commit_draw(self, burst: list[Candidate], nbytes: int) -> None:
        seg_id, pending = self._todo[0]
        del pending[: len(burst)]
        self._drawn.append((seg_id, len(burst)))
        self.drawn_bytes += nbytes

    def stop(self) -> None:
        self._stopped = True

    def settle(self, moved_per_burst: list[int]) -> None:
        """What a relocation moved of each burst drawn for it (a record that changed meanwhile stays put)."""
        drawn, self._drawn = self._drawn, []
        bursts = zip(drawn, moved_per_burst, strict=True)
        self._missed.update(seg for (seg, records), moved in bursts if moved < records)

    def compacted(self) -> int:
        """Segments drawn to the end whose every record moved."""
        return sum(1 for seg_id in self._done if seg_id not in self._missed)
