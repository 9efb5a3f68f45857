"""The inventory's walk over index pages as columns gives what classifying and counting each record on its own gives
(the rules as written one record at a time, below):
one store holding every case the rules tell apart (live, stale, quarantined, corrupt index value, segment missing,
segment cut short, layout contradicting the version key, format v1 entries, records accessed, a corrupt access time),
walked both ways."""

from __future__ import annotations

import dataclasses
import gc
import os
import tarfile
import time

import torch
import xxhash

from kvtier.core import CacheForm
from kvtier.core.profile import load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DiskStore, QuarantineReason, RecordInfo, RecordState, StoreConfig, encode_key
from kvtier.verifier import inventory
from kvtier.verifier.checks import VERDICTS, Finding, NamespaceView, SegmentFiles, Verdict, classify_page
from kvtier.verifier.inventory import Inventory, take_inventory
from kvtier.verifier.layouts import LayoutOracle
from kvtier.verifier.policy import Candidate
from support.corrupt import flip_payload_bit, segment_path
from support.verifier_helpers import DIGEST, VK, VK_OLD, entries, key, payload

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "store", "data")
FORMS = (CacheForm.COMPRESSED, CacheForm.INDEXER, CacheForm.SWA)


def _every_case(tmp_path) -> tuple[str, dict[str, ObjectKey]]:
    """A format v1 store (its entries stay v1) that v2 records were written into, then damaged in each way."""
    with tarfile.open(os.path.join(DATA, "v1-store.tar.gz")) as tar:
        tar.extractall(tmp_path, filter="data")
    root = str(tmp_path / "store")
    prof = load_profile("ref-tiny")
    checkable = prof.version.bumped(weights_digest="w-inventory")
    named: dict[str, ObjectKey] = {}
    with DiskStore(root, StoreConfig(segment_bytes=64 << 10), writer=True) as s:
        live, old = s.register_namespace(VK), s.register_namespace(VK_OLD)
        keys = [key(ns, f"{ns.hex()[:4]}-{i}", FORMS[i % 3]) for ns in (live, old) for i in range(60)]
        for k in keys:
            s.store(k, payload(k.block_hash.hex(), 3000 + 100 * (keys.index(k) % 7)), DIGEST)
        ns = s.register_namespace(checkable)
        good_digest = dataclasses.replace(prof, version=checkable).layout(prof.group("c4")).digest
        named["layout_ok"], named["layout_bad"] = (
            ObjectKey(ns, xxhash.xxh3_128_digest(t), "c4", prof.group("c4").form) for t in (b"ok", b"bad")
        )
        s.store(named["layout_ok"], payload("ok", 4096), good_digest)
        s.store(named["layout_bad"], payload("bad", 4096), b"X" * 16)
        s.retire_namespace(old)
        named["quarantined"] = keys[3]
        s.quarantine(keys[3], QuarantineReason.PAYLOAD)
        s.pin(keys[4:8], 3600.0)
        # records read have access times; one of them is corrupt in the index
        sizes = entries(s)
        s.load_into([LoadRequest(k, torch.empty(sizes[k].payload_len, dtype=torch.uint8), DIGEST) for k in keys[10:14]])
        s.flush_atimes()
        index = s._ctx.index
        named["bad_value"], named["bad_seal"], named["bad_atime"] = keys[20], keys[21], keys[11]

        def damage(txn) -> None:
            txn.put(encode_key(keys[20]), b"not an index value", db=index.obj)
            value = bytearray(txn.get(encode_key(keys[21]), db=index.obj))
            value[9] ^= 0x40  # a v2 value whose seal no longer checks
            txn.put(encode_key(keys[21]), bytes(value), db=index.obj)
            txn.put(encode_key(keys[11]), b"garbage", db=index.atime)

        index.update(damage)
        by_segment: dict[int, list[ObjectKey]] = {}
        for k, e in entries(s).items():
            if k.namespace == live and e is not None:
                by_segment.setdefault(e.segment, []).append(k)
    segs = sorted(by_segment)
    assert len(segs) >= 3, "the live records span several segments"
    os.unlink(segment_path(root, segs[0]))  # every record of it: segment_missing
    with DiskStore(root) as s:
        last = max(by_segment[segs[1]], key=lambda k: entries(s)[k].offset)
        cut = entries(s)[last]
        flipped = by_segment[segs[2]][0]
        flip_payload_bit(root, entries(s)[flipped], 10, 3)
    os.truncate(segment_path(root, segs[1]), cut.offset + cut.record_len - 1)
    named["missing"], named["truncated"], named["flipped"] = by_segment[segs[0]][0], last, flipped
    assert {k.namespace for k in named.values()} >= {live}
    return root, named


def _walk(store: DiskStore) -> tuple[NamespaceView, SegmentFiles, LayoutOracle, list[RecordInfo]]:
    rows: list[RecordInfo] = []
    after = None
    while batch := store.iter_records(after=after, limit=7):
        rows += batch
        after = batch[-1].key
    return NamespaceView(store), SegmentFiles(os.path.join(store.root, "segments")), LayoutOracle.load(), rows


def classify(
    info: RecordInfo, seen_at: float, namespaces: NamespaceView, files: SegmentFiles, oracle: LayoutOracle
) -> Finding:
    """The rules one record at a time, in their order: the spec `classify_page` is held to."""
    e = info.entry
    if e is None:
        return Finding(Verdict.CORRUPT, QuarantineReason.INDEX_VALUE)
    if e.state is RecordState.QUARANTINED:
        return Finding(Verdict.QUARANTINED)
    ns = namespaces.get(info.key.namespace, seen_at)
    if ns is None or not ns.live:
        return Finding(Verdict.STALE)
    end = e.offset + e.record_len
    size = files.size(e.segment, end)
    if size is None:
        return Finding(Verdict.CORRUPT, QuarantineReason.SEGMENT_MISSING)
    if size < end:
        return Finding(Verdict.CORRUPT, QuarantineReason.SEGMENT_TRUNCATED)
    expected = oracle.expected(ns.version_key, info.key.group)
    if expected is not None and expected != e.layout_digest:
        return Finding(Verdict.CORRUPT, QuarantineReason.LAYOUT)
    return Finding(Verdict.SERVING)


def _reference(rows: list[RecordInfo], findings: list, verified_now: set[int]) -> Inventory:
    """The inventory counted one record at a time, as the rules read."""
    inv = Inventory()
    for i, (info, f) in enumerate(zip(rows, findings)):
        e, c = info.entry, inv.form(info.key.namespace, info.key.form)
        c.entries += 1
        if e is not None:
            c.bytes += e.record_len
            inv.oldest = e.created if inv.oldest is None else min(inv.oldest, e.created)
            inv.newest = e.created if inv.newest is None else max(inv.newest, e.created)
        if f.verdict is Verdict.CORRUPT:
            c.corrupt += 1
            inv.faults.append((info.key, f.fault))
        elif f.verdict is Verdict.STALE:
            c.stale += 1
            inv.stale.append((info.key, e.seq))
        else:
            q = f.verdict is Verdict.QUARANTINED
            if q:
                c.quarantined += 1
            elif i in verified_now or e.verified_at > 0:
                c.verified += 1
            else:
                c.unverified += 1
            if not q:
                inv.serving_bytes[e.segment] = inv.serving_bytes.get(e.segment, 0) + e.record_len
            inv.candidates.append(
                Candidate(info.key, e.seq, e.record_len, info.atime, e.pin_until, e.segment, q, e.quarantined_at)
            )
    return inv


def test_a_page_of_columns_classifies_every_row_as_one_row_at_a_time(tmp_path) -> None:
    root, named = _every_case(tmp_path)
    with DiskStore(root) as s:
        namespaces, files, oracle, rows = _walk(s)
        page = s.index_page(None, len(rows) + 1)
        assert [bytes(encode_key(r.key)) for r in rows] == page.keys
        assert page.atimes.tolist() == [r.atime for r in rows]
        v = classify_page(page, time.monotonic(), namespaces, files, oracle)
        one_by_one = [classify(r, time.monotonic(), namespaces, files, oracle) for r in rows]
    assert [VERDICTS[c] for c in v.verdict.tolist()] == [f.verdict for f in one_by_one]
    assert v.faults == {i: f.fault for i, f in enumerate(one_by_one) if f.verdict is Verdict.CORRUPT}
    # every case is in the store, named as it should be
    why = {r.key: f for r, f in zip(rows, one_by_one)}
    assert why[named["bad_value"]].fault is why[named["bad_seal"]].fault is QuarantineReason.INDEX_VALUE
    assert why[named["missing"]].fault is QuarantineReason.SEGMENT_MISSING
    assert why[named["truncated"]].fault is QuarantineReason.SEGMENT_TRUNCATED
    assert why[named["layout_bad"]].fault is QuarantineReason.LAYOUT
    assert why[named["layout_ok"]].verdict is Verdict.SERVING
    assert why[named["quarantined"]].verdict is Verdict.QUARANTINED
    assert {f.verdict for f in one_by_one} == set(Verdict)
    assert {r.entry.record_version for r in rows if r.entry is not None} == {1, 2}
    assert next(r for r in rows if r.key == named["bad_atime"]).atime == 0.0
    assert sum(r.atime > 0 for r in rows) > len(rows) // 2


def test_the_inventory_of_pages_is_the_inventory_counted_row_by_row(tmp_path) -> None:
    root, named = _every_case(tmp_path)
    with DiskStore(root) as s:
        namespaces, files, oracle, rows = _walk(s)
        findings = [classify(r, time.monotonic(), namespaces, files, oracle) for r in rows]
        for batch in (5, 1024):  # pages that cut the namespaces and segments anywhere, and one page
            got = take_inventory(s, namespaces, files, oracle, batch=batch)
            assert got == _reference(rows, findings, set())
        deep = take_inventory(s, NamespaceView(s), files, oracle, deep=True, batch=16)
    serving = [i for i, f in enumerate(findings) if f.verdict is Verdict.SERVING]
    flipped = next(i for i, r in enumerate(rows) if r.key == named["flipped"])
    findings[flipped] = Finding(Verdict.CORRUPT, QuarantineReason.PAYLOAD)
    want = _reference(rows, findings, {i for i in serving if i != flipped})
    assert deep == want


def test_the_walk_leaves_the_garbage_collector_as_it_found_it(tmp_path, monkeypatch) -> None:
    root, _ = _every_case(tmp_path)
    seen: list[bool] = []
    real = inventory.classify_page
    monkeypatch.setattr(inventory, "classify_page", lambda *a: seen.append(gc.isenabled()) or real(*a))
    with DiskStore(root) as s:
        namespaces, files, oracle, _ = _walk(s)
        assert gc.isenabled()
        take_inventory(s, namespaces, files, oracle, batch=5)
        assert gc.isenabled() and seen and not any(seen)  # off during the walk, back on after it
        seen.clear()
        take_inventory(s, namespaces, files, oracle, deep=True, batch=5)
        assert seen and all(seen)  # a deep walk reads every record: the collector stays on
        gc.disable()
        try:
            take_inventory(s, namespaces, files, oracle, batch=5)
            assert not gc.isenabled()
        finally:
            gc.enable()
