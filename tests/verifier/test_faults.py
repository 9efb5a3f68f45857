"""Faults injected into a real store are found and acted on by a running verifier, and `kvtier audit` counts them."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvtier.core import CacheForm, Reason
from kvtier.store import DiskStore, QuarantineReason, RecordState, StoreConfig
from kvtier.store.record import HEADER_BYTES
from kvtier.verifier import VerifierSettings, audit_store
from support.corrupt import flip_bit, flip_payload_bit, segment_path
from support.verifier_helpers import (
    VK,
    VK_OLD,
    Rec,
    age,
    assert_consistent,
    audit_json,
    cli,
    entries,
    load,
    main_inprocess,
    populate,
    start_verifier,
    stop,
    totals,
    wait_for,
)

FORMS = (CacheForm.COMPRESSED, CacheForm.INDEXER, CacheForm.SWA, CacheForm.TAIL)
ORPHAN_TAIL, STRAY_A, STRAY_B = 8192, 4096, 8192


@dataclasses.dataclass
class Faulty:
    root: str
    recs: list[Rec]
    good: list[Rec]
    corrupt_deep: list[Rec]  # found only by reading the record
    corrupt_index: list[Rec]  # found from the index + stat alone (truncated, missing segment)
    stale: list[Rec]


def build_faulty(root: str) -> Faulty:
    specs = [(VK, f"live{i}", FORMS[i % 4], 20_000 + 997 * i) for i in range(48)]
    specs += [(VK_OLD, f"old{i}", FORMS[i % 4], 10_000 + 101 * i) for i in range(8)]
    recs = populate(root, specs)
    old_ns = VK_OLD.namespace
    with DiskStore(root) as s:
        s.retire_namespace(old_ns)  # a hot model update: the old version's records drain
        es = entries(s)
    by_key = {r.key: r for r in recs}
    by_seg: dict[int, list[Rec]] = {}
    for k, e in sorted(es.items(), key=lambda kv: (kv[1].segment, kv[1].offset)):
        by_seg.setdefault(e.segment, []).append(by_key[k])
    segs = sorted(by_seg)
    assert len(segs) >= 6 and all(r.key.namespace != old_ns for s in segs[:4] for r in by_seg[s])
    s0, s1, s2, s3 = segs[:4]
    p, h = by_seg[s0][0], by_seg[s0][1]
    flip_payload_bit(root, es[p.key], 777, 2)  # payload bit flip
    flip_bit(segment_path(root, s0), es[h.key].offset + 20, 2)  # header bit flip (namespace field)
    cut = es[by_seg[s1][1].key].offset + HEADER_BYTES + 50
    os.truncate(segment_path(root, s1), cut)  # truncation: records past the cut
    truncated = [r for r in by_seg[s1] if es[r.key].offset + es[r.key].record_len > cut]
    os.unlink(segment_path(root, s2))  # a deleted segment
    with open(segment_path(root, s3), "ab") as f:  # bytes a crashed batch left past the committed tail
        f.write(os.urandom(ORPHAN_TAIL))
    age(segment_path(root, s3))
    for name, n in (("junk.tmp", STRAY_A), (f"{0xFFFFF:016x}.seg", STRAY_B)):  # stray files
        path = os.path.join(root, "segments", name)
        with open(path, "wb") as f:
            f.write(os.urandom(n))
        age(path)
    stale = [r for r in recs if r.key.namespace == old_ns]
    bad = {p.key, h.key} | {r.key for r in truncated} | {r.key for r in by_seg[s2]}
    good = [r for r in recs if r.key not in bad and r.key.namespace != old_ns]
    return Faulty(root, recs, good, [p, h], truncated + by_seg[s2], stale)


@pytest.fixture
def faulty(tmp_path) -> Faulty:
    return build_faulty(str(tmp_path / "store"))


def _check_after(f: Faulty, doc: dict) -> None:
    n_bad = len(f.corrupt_deep) + len(f.corrupt_index)
    assert doc["corrupt"] == 0 and doc["quarantined"] == n_bad == totals(doc, "quarantined")
    assert totals(doc, "stale") == 0 and doc["orphaned_bytes"] == 0
    old = next(n for n in doc["namespaces"] if n["namespace"] == VK_OLD.namespace_hex)
    assert old["live"] is False and totals({"namespaces": [old]}, "entries") == 0
    with DiskStore(f.root) as s:
        results = load(s, f.good)
        assert all(why is Reason.OK and ok for why, ok in results), "a good record was harmed"
        for why, untouched in load(s, f.corrupt_deep + f.corrupt_index):
            assert why in (Reason.CORRUPT, Reason.MISSING) and untouched
        reasons = {k: e.quarantine for k, e in entries(s).items() if e.state is RecordState.QUARANTINED}
    assert reasons[f.corrupt_deep[0].key] is QuarantineReason.PAYLOAD
    assert reasons[f.corrupt_deep[1].key] is QuarantineReason.HEADER
    assert {reasons[r.key] for r in f.corrupt_index} == {
        QuarantineReason.SEGMENT_TRUNCATED,
        QuarantineReason.SEGMENT_MISSING,
    }
    assert not os.path.exists(os.path.join(f.root, "segments", "junk.tmp"))
    assert_consistent(f.root)


def test_audit_counts_before_and_after_fix(faulty: Faulty, capsys) -> None:
    f = faulty
    rc, doc = audit_json(capsys, f.root)
    assert rc == 1
    assert set(doc) >= {
        "store",
        "format_version",
        "namespaces",
        "orphaned_bytes",
        "reclaimable_bytes",
        "used_bytes",
        "budget_bytes",
        "corrupt",
        "quarantined",
    }
    assert doc["format_version"] == 2 and doc["store"] == os.path.abspath(f.root)
    assert doc["corrupt"] == len(f.corrupt_index) and doc["quarantined"] == 0  # the index alone sees these
    assert doc["orphaned_bytes"] == ORPHAN_TAIL + STRAY_A + STRAY_B
    assert totals(doc, "stale", live=False) == len(f.stale) and totals(doc, "stale", live=True) == 0
    assert totals(doc, "entries") == len(f.recs) and totals(doc, "unverified") == len(f.recs) - len(f.stale) - len(
        f.corrupt_index
    )
    assert doc["used_bytes"] == totals(doc, "bytes") and doc["reclaimable_bytes"] >= doc["orphaned_bytes"]
    live = next(n for n in doc["namespaces"] if n["live"])
    assert live["version_key"]["model_id"] == VK.model_id and set(live["forms"]) == {f.value for f in FORMS}

    rc, deep = audit_json(capsys, f.root, "--deep")
    assert rc == 1 and deep["corrupt"] == len(f.corrupt_index) + 2
    assert totals(deep, "verified") == len(f.good) and totals(deep, "unverified") == 0
    # a deep audit names every corrupt record and why (a plain one only the index's)
    named = {(r["block_hash"], r["reason"]) for r in deep["corrupt_records"]}
    assert deep["deep"] and not doc["deep"] and len(deep["corrupt_records"]) == deep["corrupt"]
    assert (f.corrupt_deep[0].key.block_hash.hex(), "payload") in named
    assert (f.corrupt_deep[1].key.block_hash.hex(), "header") in named
    with DiskStore(f.root) as s:  # audit without --fix changed nothing
        assert not any(e.state is RecordState.QUARANTINED for e in entries(s).values())

    rc, out, err = main_inprocess(capsys, "audit", "--store", f.root, "--fix")
    assert rc == 1, err  # corruption and orphans were found (and fixed)
    assert "fixed:" in out and "quarantined" in out and "namespace" in out
    rc, after = audit_json(capsys, f.root)
    assert rc == 0, after
    _check_after(f, after)


def test_running_verifier_finds_and_acts_on_every_fault(faulty: Faulty) -> None:
    f = faulty
    n_bad = len(f.corrupt_deep) + len(f.corrupt_index)
    proc = start_verifier(f.root)

    def settled() -> dict | None:
        with DiskStore(f.root, StoreConfig(io_backend="buffered"), readonly=True) as s:
            doc = audit_store(s, VerifierSettings()).to_json()
        done = (
            doc["quarantined"] == n_bad
            and doc["corrupt"] == 0
            and totals(doc, "stale") == 0
            and doc["orphaned_bytes"] == 0
        )
        return doc if done else None

    try:
        doc = wait_for(settled, 30.0, proc, "every fault quarantined, retired or reclaimed")
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    _check_after(f, doc)
    assert "Traceback" not in err


def test_audit_usage_errors_are_one_line(tmp_path, capsys) -> None:
    res = cli("audit", "--store", str(tmp_path / "nope"), "--json")  # the installed entry point, as a process
    assert res.returncode == 2 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1
    assert "no kvtier store" in res.stderr and "Traceback" not in res.stderr
    code, _, err = main_inprocess(capsys, "audit", "--json")
    assert code == 2 and "--store" in err


def test_deep_audit_shows_a_progress_bar_on_stderr_only(faulty: Faulty, capsys) -> None:
    code, out, err = main_inprocess(capsys, "audit", "--store", faulty.root, "--deep")
    assert code == 1 and "rec" in err and "100%" in err
    assert "100%" not in out and "namespace" in out and "retired" in out and "live" in out
    # the text says it was deep and names the corrupt records, unlike a plain audit's
    bad = faulty.corrupt_deep[0].key
    assert "checked      deep" in out and f"block {bad.block_hash.hex()}" in out and ": payload" in out
    code, plain, _ = main_inprocess(capsys, "audit", "--store", faulty.root)
    assert code == 1 and "index only" in plain and bad.block_hash.hex() not in plain
