"""One pass over the index: per namespace and form counts, faults, stale records, eviction candidates, live bytes."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import ObjectKey
from kvtier.store import RECORD_FORMS, DiskStore, QuarantineReason, RecordInfo
from kvtier.verifier.checks import Finding, NamespaceView, SegmentFiles, Verdict, classify
from kvtier.verifier.layouts import LayoutOracle
from kvtier.verifier.policy import Candidate
from kvtier.verifier.throttle import RateLimiter

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class FormCounts:
    """A partition of one namespace's records of one form: every entry is in exactly one of the five states."""

    entries: int = 0
    bytes: int = 0
    verified: int = 0
    unverified: int = 0
    corrupt: int = 0
    quarantined: int = 0
    stale: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class Inventory:
    counts: dict[bytes, dict[CacheForm, FormCounts]] = dataclasses.field(default_factory=dict)
    faults: list[tuple[ObjectKey, QuarantineReason]] = dataclasses.field(default_factory=list)
    stale: list[tuple[ObjectKey, int]] = dataclasses.field(default_factory=list)  # (key, seq)
    candidates: list[Candidate] = dataclasses.field(default_factory=list)  # serving and quarantined records
    serving_bytes: dict[int, int] = dataclasses.field(default_factory=dict)  # segment -> bytes of serving records
    oldest: float | None = None
    newest: float | None = None

    def form(self, ns: bytes, form: CacheForm) -> FormCounts:
        per = self.counts.get(ns)
        if per is None:
            per = self.counts[ns] = {f: FormCounts() for f in RECORD_FORMS}
        return per[form]

    def total(self, field: str) -> int:
        return sum(getattr(c, field) for per in self.counts.values() for c in per.values())


Progress = Callable[[int], object]  # what it returns is ignored (tqdm.update returns a bool)


def take_inventory(
    store: DiskStore,
    namespaces: NamespaceView,
    files: SegmentFiles,
    oracle: LayoutOracle,
    *,
    deep: bool = False,
    batch: int = 256,
    read_bytes: int = 1 << 20,
    limiter: RateLimiter | None = None,
    progress: Progress | None = None,
) -> Inventory:
    """Walk every index row in short read transactions; `deep` also re-reads and checksums every serving record
    (without acting: faults are reported in `faults`, the caller decides)."""
    inv = Inventory()
    after: ObjectKey | None = None
    while True:
        seen_at = time.monotonic()
        rows = store.iter_records(after=after, limit=batch)
        if not rows:
            return inv
        after = rows[-1].key
        findings = [classify(r, seen_at, namespaces, files, oracle) for r in rows]
        passed = deep_check(store, rows, findings, limiter, read_bytes=read_bytes) if deep else set()
        for i, (info, finding) in enumerate(zip(rows, findings)):
            _count(inv, info, finding, i in passed)
        if progress is not None:
            progress(len(rows))


def deep_check(
    store: DiskStore,
    rows: list[RecordInfo],
    findings: list[Finding],
    limiter: RateLimiter | None,
    *,
    read_bytes: int,
    stamp_bytes: int = 0,
    apply: bool = False,
) -> set[int]:
    """Re-read and checksum the serving rows; failures become CORRUPT findings in place. Returns the indices that
    passed.

    With `apply` failures are quarantined, and rows never verified are stamped verified (clearing their dirty
    rows) by the store, one synced index commit per `stamp_bytes` of records. Rows already verified are read in
    chunks of `read_bytes` and nothing is written for them: a re-stamp would cost a synced commit per chunk
    for nothing (only whether a record was ever verified is read back), and small chunks keep each of the
    verifier's reads short, so a reader's request queued behind one at the disk waits little."""
    passed: set[int] = set()
    serving = [i for i, f in enumerate(findings) if f.verdict is Verdict.SERVING]
    fresh = [i for i in serving if apply and rows[i].entry.verified_at == 0]  # type: ignore[union-attr]
    known = [i for i in serving if not (apply and rows[i].entry.verified_at == 0)]  # type: ignore[union-attr]
    for todo, limit, stamp in ((fresh, stamp_bytes, True), (known, read_bytes, False)):
        if not stamp and limiter is not None:  # re-reads shrink while the disk is busy (RateLimiter.burst); stamping
            limit = limiter.burst(limit)  # batches keep their size, since each is a synced commit
        for chunk, size in _chunks(rows, todo, limit):
            if limiter is not None and not limiter.take(size):
                return passed
            for i, res in zip(chunk, store.verify_many([rows[i].key for i in chunk], apply=stamp)):
                if res.failure is not None:
                    findings[i] = Finding(Verdict.CORRUPT, res.failure)
                    if apply and not stamp:
                        key = rows[i].key
                        log.warning(
                            "quarantining %s/%s/%s: %s",
                            key.namespace.hex(),
                            key.block_hash.hex(),
                            key.group,
                            res.failure.label,
                        )
                        store.quarantine(key, res.failure)
                elif res.reason is Reason.OK:
                    passed.add(i)
    return passed


def _chunks(rows: list[RecordInfo], todo: list[int], limit: int) -> Iterator[tuple[list[int], int]]:
    """Consecutive runs of `todo` of at most `limit` record bytes (at least one row each), with their size."""
    chunk: list[int] = []
    size = 0
    for i in todo:
        n = rows[i].entry.record_len  # type: ignore[union-attr]
        if chunk and size + n > limit:
            yield chunk, size
            chunk, size = [], 0
        chunk.append(i)
        size += n
    if chunk:
        yield chunk, size


def _count(inv: Inventory, info: RecordInfo, finding: Finding, verified_now: bool) -> None:
    key, e = info.key, info.entry
    c = inv.form(key.namespace, key.form)
    c.entries += 1
    if e is not None:
        c.bytes += e.record_len
        inv.oldest = e.created if inv.oldest is None else min(inv.oldest, e.created)
        inv.newest = e.created if inv.newest is None else max(inv.newest, e.created)
    v = finding.verdict
    if v is Verdict.CORRUPT:
        c.corrupt += 1
        assert finding.fault is not None
        inv.faults.append((key, finding.fault))
    elif v is Verdict.STALE:
        c.stale += 1
        inv.stale.append((key, e.seq if e is not None else 0))
    elif e is not None:
        quarantined = v is Verdict.QUARANTINED
        if quarantined:
            c.quarantined += 1
        elif verified_now or e.verified_at > 0:
            c.verified += 1
        else:
            c.unverified += 1
        if not quarantined:
            inv.serving_bytes[e.segment] = inv.serving_bytes.get(e.segment, 0) + e.record_len
        inv.candidates.append(
            Candidate(key, e.seq, e.record_len, info.atime, e.pin_until, e.segment, quarantined, e.quarantined_at)
        )
