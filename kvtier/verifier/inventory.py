"""One pass over the index: per namespace and form counts, faults, stale records, eviction candidates, live bytes."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import ObjectKey
from kvtier.store import RECORD_FORMS, DiskStore, IndexPage, QuarantineReason, RecordInfo
from kvtier.verifier.checks import (
    CORRUPT_CODE,
    QUARANTINED_CODE,
    SERVING,
    SERVING_CODE,
    STALE_CODE,
    Finding,
    NamespaceView,
    PageVerdicts,
    SegmentFiles,
    Verdict,
    classify_page,
)
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
    batch: int = 1024,
    read_bytes: int = 1 << 20,
    limiter: RateLimiter | None = None,
    progress: Progress | None = None,
) -> Inventory:
    """Walk every index row in short read transactions, a page of columns each (`DiskStore.index_page`,
    `classify_page`): every maintenance pass walks the whole index, so a row costs no Python object unless the
    cleaner may act on it. `deep` also re-reads and checksums every serving record (without acting: faults are
    reported in `faults`, the caller decides)."""
    inv = Inventory()
    after: bytes | None = None
    with _cyclic_gc_paused() if not deep else contextlib.nullcontext():
        while True:
            seen_at = time.monotonic()
            page = store.index_page(after, batch)
            if not len(page):
                return inv
            after = page.keys[-1]
            verdicts = classify_page(page, seen_at, namespaces, files, oracle)
            verified = page.entries["verified_at"] > 0
            if deep:
                _deep(store, page, verdicts, verified, limiter, read_bytes)
            _count(inv, page, verdicts, verified)
            if progress is not None:
                progress(len(page))


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while the walk builds its candidates: a collection is set off every few
    hundred objects made and goes through all the young ones, which cost the walk a third of its CPU. What the walk
    builds holds no cycles; the collector is back on, as it was, when the walk ends. Not for a deep walk: it reads
    every record, which costs far more than the collections, and what its reads leave is not known to be free of
    cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _deep(
    store: DiskStore,
    page: IndexPage,
    verdicts: PageVerdicts,
    verified: np.ndarray,
    limiter: RateLimiter | None,
    read_bytes: int,
) -> None:
    """`deep_check` of the page's serving rows: a failure demotes its row to CORRUPT, a pass marks it verified."""
    numbers, rows = serving_rows(page, verdicts)
    findings = [SERVING] * len(rows)
    passed = deep_check(store, rows, findings, limiter, read_bytes=read_bytes)
    for row, finding in zip(numbers, findings):
        if finding.fault is not None:
            verdicts.demote(row, finding.fault)
    verified[[numbers[j] for j in passed]] = True


def serving_rows(page: IndexPage, verdicts: PageVerdicts) -> tuple[list[int], list[RecordInfo]]:
    """The page's serving rows, by number and as the records `deep_check` re-reads."""
    numbers = np.flatnonzero(verdicts.verdict == SERVING_CODE).tolist()
    keys = page.keys_at(numbers)
    return numbers, [RecordInfo(key, page.entry(i), float(page.atimes[i])) for key, i in zip(keys, numbers)]


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


def _count(inv: Inventory, page: IndexPage, v: PageVerdicts, verified: np.ndarray) -> None:
    """Add the page's rows to the inventory: the counts per namespace and form (columns summed), then the rows the
    cleaner may act on (faults, stale records, candidates) one by one."""
    e, code, parsed = page.entries, v.verdict, page.parsed
    serving, quarantined = code == SERVING_CODE, code == QUARANTINED_CODE
    lengths = np.where(parsed, e["record_len"], 0)
    per_form = len(v.forms)
    sums = {
        "entries": np.bincount(v.form_of, minlength=per_form),
        "bytes": np.bincount(v.form_of, weights=lengths, minlength=per_form),
        "verified": np.bincount(v.form_of[serving & verified], minlength=per_form),
        "unverified": np.bincount(v.form_of[serving & ~verified], minlength=per_form),
        "corrupt": np.bincount(v.form_of[code == CORRUPT_CODE], minlength=per_form),
        "quarantined": np.bincount(v.form_of[quarantined], minlength=per_form),
        "stale": np.bincount(v.form_of[code == STALE_CODE], minlength=per_form),
    }
    for f, (ns, form) in enumerate(v.forms):
        c = inv.form(ns, form)
        for name, col in sums.items():
            setattr(c, name, getattr(c, name) + int(col[f]))
    if parsed.any():
        created = e["created"][parsed]
        lo, hi = float(created.min()), float(created.max())
        inv.oldest = lo if inv.oldest is None else min(inv.oldest, lo)
        inv.newest = hi if inv.newest is None else max(inv.newest, hi)
    inv.faults += v.keyed_faults(page)
    stale = np.flatnonzero(code == STALE_CODE)
    inv.stale += list(zip(page.keys_at(stale.tolist()), e["seq"][stale].tolist()))
    if serving.any():
        segs, at = np.unique(e["segment"][serving], return_inverse=True)
        for seg, n in zip(segs.tolist(), np.bincount(at, weights=e["record_len"][serving]).tolist()):
            inv.serving_bytes[seg] = inv.serving_bytes.get(seg, 0) + int(n)
    rows = np.flatnonzero(serving | quarantined)
    cols = (e[name][rows].tolist() for name in ("seq", "record_len", "pin_until", "segment", "quarantined_at"))
    inv.candidates += [
        Candidate(key, seq, n, atime, pin, seg, q, qat)
        for key, seq, n, pin, seg, qat, atime, q in zip(
            page.keys_at(rows.tolist()), *cols, page.atimes[rows].tolist(), quarantined[rows].tolist()
        )
    ]
