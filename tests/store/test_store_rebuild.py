"""Index loss and rebuild from segments alone; dry-run reports; newer formats refused; the writer lock."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import lmdb
import pytest
import torch
import xxhash

from kvtier.core import CacheForm, Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, FormatVersionError, StoreConfig, StoreLocked, rebuild_index
from kvtier.store.index import seal
from kvtier.store.record import HEADER_BYTES, record_length
from support.corrupt import flip_payload_bit
from support.store_helpers import DIGEST, VK, make_key, make_payload, subprocess_env

VK2 = VK.bumped(kernel_abi="abi-2")


def _populate(root: str) -> list[tuple]:
    """Two namespaces, a zstd form, records spread over several segments; returns (key, tag, size)."""
    rows = []
    with DiskStore(root, StoreConfig(segment_bytes=256 << 10), writer=True) as s:
        ns1 = s.register_namespace(VK, codecs={CacheForm.SWA: "zstd"})
        ns2 = s.register_namespace(VK2)
        for i in range(24):
            ns = ns1 if i % 3 else ns2
            form, group = (CacheForm.SWA, "swa") if i % 4 == 0 else (CacheForm.INDEXER, "idx")
            tag, size = f"t{i}", 3000 + 9000 * (i % 5)
            key = make_key(ns, tag, group, form)
            s.store(key, make_payload(tag, size), DIGEST)
            rows.append((key, tag, size))
        assert len(s.segments()) >= 3
    return rows


def _all_load(root: str, rows) -> list[Reason]:
    with DiskStore(root) as s:
        outs = [torch.empty(n, dtype=torch.uint8) for _, _, n in rows]
        reasons = s.load_into([LoadRequest(k, o, DIGEST) for (k, _, _), o in zip(rows, outs)])
        for (_k, tag, n), r, o in zip(rows, reasons, outs):
            if r is Reason.OK:
                assert torch.equal(o, make_payload(tag, n))
        return reasons


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "store", *args], capture_output=True, text=True, env=subprocess_env()
    )


def test_deleted_index_is_rebuilt_by_the_cli_with_every_record(tmp_path) -> None:
    root = str(tmp_path / "s")
    rows = _populate(root)
    with DiskStore(root) as s:
        before = s.stats()
    shutil.rmtree(os.path.join(root, "index.lmdb"))
    res = _cli("rebuild-index", "--store", root, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["records_after"] == 24 and report["namespaces_after"] == 2 and report["orphan_bytes"] == 0
    assert _all_load(root, rows) == [Reason.OK] * 24
    with DiskStore(root) as s:
        after = s.stats()
        assert {ns: e.version_key for ns, e in s.namespaces().items()} == {VK.namespace: VK, VK2.namespace: VK2}
        assert s.namespaces()[VK.namespace].codec_for(CacheForm.SWA).name == "ZSTD"
        assert s.iter_dirty() == []  # rebuild verified every payload
    assert after["forms"] == before["forms"] and after["records"] == before["records"]
    with DiskStore(root, writer=True) as w:  # and the store keeps working: new segment ids do not collide
        k = make_key(VK.namespace, "after", "idx", CacheForm.INDEXER)
        w.store(k, make_payload("after", 5000), DIGEST)
    assert _all_load(root, [(k, "after", 5000)]) == [Reason.OK]


def test_rebuild_with_a_readable_index_keeps_retirement_and_pins(tmp_path) -> None:
    root = str(tmp_path / "s")
    rows = _populate(root)
    with DiskStore(root) as s:
        s.retire_namespace(VK2.namespace)
        assert s.pin([rows[1][0]], ttl_s=3600) == 1
        pin = next(r.entry.pin_until for r in s.iter_records() if r.key == rows[1][0])
    report = rebuild_index(root)
    assert report.index_present and report.missing_records == 0
    reasons = _all_load(root, rows)
    assert reasons == [Reason.STALE_VERSION if k.namespace == VK2.namespace else Reason.OK for k, _, _ in rows]
    with DiskStore(root) as s:
        assert [r.entry.pin_until for r in s.iter_records() if r.key == rows[1][0]] == [pin]


def test_dry_run_reports_orphans_and_corruption_without_changing_anything(tmp_path) -> None:
    root = str(tmp_path / "s")
    rows = _populate(root)
    clean = rebuild_index(root, dry_run=True)
    assert (clean.orphan_bytes, clean.orphan_records, clean.corrupt_extents, clean.missing_records) == (0, 0, 0, 0)
    assert clean.namespaces_after >= 1  # what a real run would write, not 0
    with DiskStore(root) as s:
        victim = next(r.entry for r in s.iter_records() if r.key == rows[5][0])
        s.remove([rows[6][0]])
    flip_payload_bit(root, victim, 1, 0)
    index_mtime = os.path.getmtime(os.path.join(root, "index.lmdb", "data.mdb"))
    res = _cli("rebuild-index", "--store", root, "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["corrupt_extents"] == 1 and report["missing_records"] == 1 and report["orphan_records"] == 1
    assert report["orphan_bytes"] == record_length(rows[6][2]) and report["records_after"] == 23
    assert os.path.getmtime(os.path.join(root, "index.lmdb", "data.mdb")) == index_mtime
    assert report["namespaces_after"] == rebuild_index(root).namespaces_after  # the dry run's figure is the real one


def test_newer_index_format_is_refused_not_rebuilt_over(tmp_path) -> None:
    root = str(tmp_path / "s")
    _populate(root)
    env = lmdb.open(os.path.join(root, "index.lmdb"), max_dbs=8)
    meta = env.open_db(b"meta")  # before the write txn: open_db begins one of its own
    with env.begin(write=True) as txn:
        txn.put(b"format_version", seal((99).to_bytes(8, "big")), db=meta)
    env.close()
    for dry_run in (True, False):
        with pytest.raises(FormatVersionError, match=r"v99.*upgrade kvtier"):
            rebuild_index(root, dry_run=dry_run)
    res = _cli("rebuild-index", "--store", root)
    assert res.returncode == 2 and "upgrade kvtier" in res.stderr and "Traceback" not in res.stderr
    assert not os.path.exists(os.path.join(root, "index.lmdb.rebuild"))


def test_newer_record_format_is_refused_not_guessed(tmp_path) -> None:
    root = str(tmp_path / "s")
    _populate(root)
    seg = sorted(os.listdir(os.path.join(root, "segments")))[0]
    with open(os.path.join(root, "segments", seg), "r+b") as f:
        block = bytearray(f.read(HEADER_BYTES))
        struct.pack_into("<H", block, 8, 99)
        struct.pack_into("<Q", block, HEADER_BYTES - 8, xxhash.xxh3_64_intdigest(bytes(block[: HEADER_BYTES - 8])))
        f.seek(0)
        f.write(block)
    with pytest.raises(FormatVersionError, match="v99"):
        rebuild_index(root, dry_run=True)
    res = _cli("rebuild-index", "--store", root)
    assert res.returncode == 2 and "upgrade kvtier" in res.stderr and "Traceback" not in res.stderr


def test_rebuild_needs_the_writer_lock(tmp_path) -> None:
    root = str(tmp_path / "s")
    with DiskStore(root, writer=True), pytest.raises(StoreLocked):
        rebuild_index(root)
