"""The verifier/cleaner loop: verify what was written, sweep everything slowly, act on what the index shows.

Work is found from the index (the dirty table, then a rate-limited full sweep); watchdog events on segments/
only wake the loop early. Every read transaction covers one bounded batch; every write transaction is a
bounded batch of conditional changes. Progress and counters are persisted, so a kill -9 costs at most a
few seconds of repeated work.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

import lmdb

from kvtier.core.errors import KvtierError
from kvtier.core.verifier_status import VERIFIER_DOC
from kvtier.store import DiskStore, IndexPage, encode_key
from kvtier.verifier.busy import DeviceActivity
from kvtier.verifier.checks import SERVING, NamespaceView, SegmentFiles, Verdict, classify_page
from kvtier.verifier.cleaner import Cleaner
from kvtier.verifier.hints import SegmentHints
from kvtier.verifier.inventory import deep_check, serving_rows, take_inventory
from kvtier.verifier.layouts import LayoutOracle
from kvtier.verifier.settings import VerifierSettings
from kvtier.verifier.state import SweepProgress
from kvtier.verifier.survey import survey_segments
from kvtier.verifier.throttle import RateLimiter

log = logging.getLogger(__name__)

HINT_SETTLE_S = 2.0  # after a watchdog hint, re-check this long ...
HINT_SETTLE_POLL_S = 0.05  # ... at this interval


class Verifier:
    """One verifier over one store (opened in this process, not read-only, never the writer)."""

    def __init__(self, store: DiskStore, settings: VerifierSettings, oracle: LayoutOracle | None = None) -> None:
        self.store = store
        self.settings = settings
        self.oracle = oracle or LayoutOracle.load(settings.profiles)
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self._seg_dir = store.segment_dir
        disk = DeviceActivity.of_root(self._seg_dir)
        if not disk.available:
            log.info("the statistics of the disk under %s are unavailable: pacing at the full rate", self._seg_dir)
        self.limiter = RateLimiter(settings.rate_bytes_per_s, self.stop_event, settings.busy_rate_bytes_per_s, disk)
        doc = store.meta_doc(VERIFIER_DOC) or {}
        self.actions: collections.Counter[str] = collections.Counter(
            {k: int(v) for k, v in doc.get("actions", {}).items()}
        )
        self.sweep = SweepProgress.from_doc(doc.get("sweep", {}))
        self.cleaner = Cleaner(store, settings, self.limiter, self.actions)
        self.namespaces = NamespaceView(store)
        self.files = SegmentFiles(self._seg_dir)
        self.phase = "starting"
        self.ready = False
        self.started_at = time.time()
        self._dirty_after = 0
        self._next_maintenance = 0.0
        self._next_limit_check = 0.0
        self._saved_at = 0.0
        self._hinted_at = -HINT_SETTLE_S
        self._pending_settings: VerifierSettings | None = None
        self._persist = True  # False for a one-off pass (audit --fix): the running verifier owns the document

    # -- control -------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stop_event.set()
        self.wake.set()

    def reload(self, settings: VerifierSettings) -> None:
        """Take new rates and limits at the next step (called on a SIGHUP's own thread, `process.off_handler`)."""
        self._pending_settings = settings
        self.wake.set()

    def _apply_settings(self) -> None:
        new, self._pending_settings = self._pending_settings, None
        if new is not None:
            self.settings = self.cleaner.settings = new
            self.limiter.set_rate(new.rate_bytes_per_s, new.busy_rate_bytes_per_s)
            self._next_maintenance = 0.0
            log.info(
                "reloaded: rate %d B/s (%d B/s while the disk is busy), sweep every %.0fs",
                new.rate_bytes_per_s,
                new.busy_rate_bytes_per_s,
                new.sweep_interval_s,
            )

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        """Until request_stop(): verify new records, sweep, maintain; sleep on hints or the poll interval."""
        hints = SegmentHints(self._seg_dir, self.wake)
        hints.start()
        self._save(force=True)  # a first heartbeat before the first step, which may be long (a maintenance pass)
        try:
            while not self.stop_event.is_set():
                try:
                    worked = self.step()
                except (KvtierError, OSError, lmdb.Error) as exc:  # transient: log, back off, go on
                    if self.stop_event.is_set():  # a step cut short by the stop (its decisions refused): no fault
                        log.info("verifier step ended by the stop: %s", exc)
                        break
                    log.exception("verifier step failed: %s", exc)
                    worked = False
                self._save()
                if not worked and not self.stop_event.is_set():
                    self.phase = "idle"
                    if self.wake.wait(self._idle_timeout()):
                        self._hinted_at = time.monotonic()
                    self.wake.clear()
        finally:
            hints.stop()
            self.phase = "stopped"
            self._save(force=True)

    def step(self) -> bool:
        """One bounded unit of work; False when there was nothing to do."""
        self._apply_settings()
        now = time.monotonic()
        if now >= self._next_maintenance or self._over_limits(now):
            self.maintain()
            self._next_maintenance = time.monotonic() + self.settings.maintenance_interval_s
        if self.verify_dirty():
            return True
        self.ready = True
        if self._sweep_due():
            return self.sweep_step()
        return False

    def run_once(self) -> dict[str, int]:
        """`kvtier audit --fix`: a full sweep from the start, then the cleaner's actions (twice, so segments
        that compaction emptied are unlinked when no reader holds them). Returns the actions taken."""
        self._persist = False
        before = collections.Counter(self.actions)
        self.store.seal_abandoned_segments()
        self.sweep = SweepProgress()
        self._start_sweep()
        while self.sweep.in_progress and not self.stop_event.is_set():
            self.sweep_step()
        self.maintain()
        self.maintain()
        return {k: v - before.get(k, 0) for k, v in self.actions.items() if v - before.get(k, 0)}

    # -- work ----------------------------------------------------------------------------------------

    def maintain(self) -> None:
        """Index-level checks of every record and the segment directory, then the cleaner's actions."""
        self.phase = "maintenance"
        self.store.reader_check()
        self.actions["segments_sealed"] += self.store.seal_abandoned_segments()
        self.namespaces.refresh()
        self.files = SegmentFiles(self._seg_dir)
        survey = survey_segments(self.store, self.settings.orphan_grace_s)
        inv = take_inventory(
            self.store, self.namespaces, self.files, self.oracle, batch=4 * self.settings.batch_records
        )
        self.cleaner.act(survey, inv, self.namespaces)
        self.store.reader_check()

    def verify_dirty(self) -> bool:
        """Check a batch of records written since they were last verified (the dirty table is the truth)."""
        rows = self.store.iter_dirty(after_seq=self._dirty_after, limit=self.settings.batch_records)
        if not rows:
            return False
        self.phase = "verifying"
        self._dirty_after = rows[-1][0]
        seen_at = time.monotonic()
        self._check(self.store.records_page([k for _, k in rows]), seen_at)
        return True

    def _sweep_due(self) -> bool:
        return self.sweep.in_progress or time.time() - self.sweep.last_completed_at >= self.settings.sweep_interval_s

    def _start_sweep(self) -> None:
        self.sweep = SweepProgress(True, None, time.time(), self.sweep.last_completed_at)
        log.info("full sweep started")

    def sweep_step(self) -> bool:
        """Verify the next batch of the full sweep (resumes from the persisted cursor)."""
        if not self.sweep.in_progress:
            self._start_sweep()
        self.phase = "sweeping"
        seen_at = time.monotonic()
        after = encode_key(self.sweep.cursor) if self.sweep.cursor is not None else None
        page = self.store.index_page(after, self.settings.batch_records)
        if not len(page):
            self.sweep.in_progress = False
            self.sweep.cursor = None
            self.sweep.last_completed_at = time.time()
            self.actions["sweeps"] += 1
            log.info("full sweep done: %d records, %d bytes", self.sweep.records, self.sweep.bytes)
            self._save(force=True)
            return True
        self._check(page, seen_at)
        self.sweep.cursor = page.key(len(page) - 1)
        self.sweep.records += len(page)
        self.sweep.bytes += int(page.entries["record_len"][page.parsed].sum())
        return True

    def _check(self, page: IndexPage, seen_at: float) -> None:
        """Index checks, then a rate-limited re-read of the serving records; quarantine what fails."""
        verdicts = classify_page(page, seen_at, self.namespaces, self.files, self.oracle)
        self.cleaner.quarantine(verdicts.keyed_faults(page))
        _, rows = serving_rows(page, verdicts)
        findings = [SERVING] * len(rows)
        passed = deep_check(
            self.store,
            rows,
            findings,
            self.limiter,
            read_bytes=self.settings.read_bytes,
            stamp_bytes=self.settings.batch_bytes,
            apply=True,
        )
        self.actions["verified"] += len(passed)
        self.actions["quarantined"] += sum(f.verdict is not Verdict.SERVING for f in findings)

    def _over_limits(self, now: float) -> bool:
        """Checked at most every poll interval: usage over the high watermark brings maintenance forward (usage
        counts the room the daemon's blocked write-back asks for)."""
        if now < self._next_limit_check:
            return False
        self._next_limit_check = now + self.settings.poll_s
        limits = self.cleaner.limits()
        usage = self.cleaner.usage()  # with the room blocked write-back asks for
        if limits.budget_bytes and sum(usage.values()) >= self.settings.evict_high * limits.budget_bytes:
            return True
        return any(q and usage.get(f, 0) >= self.settings.evict_high * q for f, q in limits.form_quotas)

    def _idle_timeout(self) -> float:
        """Until the next poll, maintenance or sweep; briefly short after a hint, because a segment write is seen
        before the writer's commit makes its records (and dirty rows) visible."""
        now = time.monotonic()
        until_maintenance = max(0.0, self._next_maintenance - now)
        until_sweep = max(0.0, self.sweep.last_completed_at + self.settings.sweep_interval_s - time.time())
        settle = HINT_SETTLE_POLL_S if now - self._hinted_at < HINT_SETTLE_S else self.settings.poll_s
        return max(0.01, min(self.settings.poll_s, settle, until_maintenance, until_sweep))

    # -- state ---------------------------------------------------------------------------------------

    def status_doc(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "started_at": self.started_at,
            "heartbeat_at": time.time(),
            "phase": self.phase,
            "ready": self.ready,
            "sweep": self.sweep.to_doc(),
            "actions": dict(self.actions),
            "paced_busy": self.limiter.paced_busy,
            "settings": {
                "rate_bytes_per_s": self.settings.rate_bytes_per_s,
                "busy_rate_bytes_per_s": self.settings.busy_rate_bytes_per_s,
                "sweep_interval_s": self.settings.sweep_interval_s,
            },
        }

    def _save(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._persist or (not force and now - self._saved_at < self.settings.state_interval_s):
            return
        try:
            self.store.put_meta_doc(VERIFIER_DOC, self.status_doc())
            self._saved_at = now
        except (KvtierError, OSError) as exc:  # (a full disk: the next save tries again)
            log.warning("cannot save verifier progress: %s", exc)
