"""One pass over the index: per namespace and form counts, faults, stale records, eviction candidates, live bytes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import ObjectKey
from kvtier.store import RECORD_FORMS, DiskStore, QuarantineReason, RecordInfo
from kvtier.verifier.checks import Finding, NamespaceView, SegmentFiles, Verdict, classify
from kvtier.verifier.layouts import LayoutOracle
from kvtier.verifier.policy import Candidate
from kvtier.verifier.throttle import RateLimiter


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


Progress = Callable[[int], None]


def take_inventory(
    store: DiskStore,
    namespaces: NamespaceView,
    files: SegmentFiles,
    oracle: LayoutOracle,
    *,
    deep: bool = False,
    batch: int = 256,
    batch_bytes: int = 8 << 20,
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
        passed = deep_check(store, rows, findings, batch_bytes, limiter) if deep else set()
        for i, (info, finding) in enumerate(zip(rows, findings)):
            _count(inv, info, finding, i in passed)
        if progress is not None:
            progress(len(rows))


def deep_check(
    store: DiskStore,
    rows: list[RecordInfo],
    findings: list[Finding],
    batch_bytes: int,
    limiter: RateLimiter | None,
    *,
    apply: bool = False,
) -> set[int]:
    """Re-read and checksum the serving rows in byte-bounded batches; failures become CORRUPT findings in place
    (quarantined by the store when `apply`). Returns the indices that passed."""
    passed: set[int] = set()
    todo = [i for i, f in enumerate(findings) if f.verdict is Verdict.SERVING]
    while todo:
        chunk, size = [], 0
        while todo and (not chunk or size + rows[todo[0]].entry.record_len <= batch_bytes):  # type: ignore[union-attr]
            i = todo.pop(0)
            chunk.append(i)
            size += rows[i].entry.record_len  # type: ignore[union-attr]
        if limiter is not None and not limiter.take(size):
            break
        for i, res in zip(chunk, store.verify_many([rows[i].key for i in chunk], apply=apply)):
            if res.failure is not None:
                findings[i] = Finding(Verdict.CORRUPT, res.failure)
            elif res.reason is Reason.OK:
                passed.add(i)
    return passed


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
