"""Format v2 extents: layout, run reads, faults inside extents, old-format stores, the device checksum path."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import torch
import xxhash

from kvtier.core import CacheForm, Reason, VersionKey
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DiskStore, QuarantineReason, StoreConfig, rebuild_index
from kvtier.store import reader as reader_mod
from kvtier.store.devsum import device_checksum
from kvtier.store.extent import BACKGROUND_IO_BYTES
from kvtier.store.io import PosixBackend, SegmentFile
from kvtier.store.record import HEADER_BYTES, Flags
from support.corrupt import flip_bit, segment_path
from support.store_helpers import DIGEST, VK, current, kept, make_key, make_payload, subprocess_env, walked

SMALL = 1000

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # a real v1 store written by c307a27


def _small_batch(root: str, n: int = 64, size: int = SMALL, **cfg) -> list[ObjectKey]:
    with DiskStore(root, StoreConfig(**cfg), writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"s{i}") for i in range(n)]
        s.store_many([(k, make_payload(f"s{i}", size), DIGEST) for i, k in enumerate(keys)])
    return keys


def _load(s: DiskStore, keys, n: int = SMALL) -> tuple[list[Reason], list[torch.Tensor]]:
    outs = [torch.full((n,), 0xAA, dtype=torch.uint8) for _ in keys]
    return s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]), outs


def test_a_batch_of_small_objects_is_one_contiguous_extent_of_about_their_size(tmp_path) -> None:
    root = str(tmp_path)
    keys = _small_batch(root)
    with DiskStore(root) as s:
        entries = sorted((r.entry for r in s.records(keys)), key=lambda e: e.offset)
        assert len({e.segment for e in entries}) == 1
        gaps = [b.offset - (a.offset + a.record_len) for a, b in itertools.pairwise(entries)]
        assert all(0 <= g < 32 for g in gaps)  # packed at 32-byte steps, in batch order
        on_disk = os.path.getsize(segment_path(root, entries[0].segment))
        assert on_disk <= 64 * (SMALL + HEADER_BYTES + 32) + 4096 + 4096  # ~1.2 KB an object, not 8 KiB
        reasons, outs = _load(s, keys)
        assert reasons == [Reason.OK] * 64
        assert all(torch.equal(o, make_payload(f"s{i}", SMALL)) for i, o in enumerate(outs))


def test_a_run_of_adjacent_records_is_one_read(tmp_path, scattered_reads) -> None:
    root = str(tmp_path)
    keys = _small_batch(root)
    with DiskStore(root) as s:
        reasons, _ = _load(s, keys[5:60])
    assert reasons == [Reason.OK] * 55 and len(scattered_reads) == 1


def test_bit_flips_in_a_shared_block_fail_only_the_records_they_hit(tmp_path, read_path) -> None:
    """One 4 KiB block holds the headers and payloads of several small records: each record checks alone."""
    root = str(tmp_path)
    keys = _small_batch(root)
    with DiskStore(root) as s:
        entries = {k: r.entry for k, r in zip(keys, s.records(keys))}
        block = entries[keys[10]].offset // 4096 * 4096
        hit = {k for k, e in entries.items() if e.offset < block + 4096 and e.offset + e.record_len > block}
        assert len(hit) >= 3
        path = segment_path(root, entries[keys[10]].segment)
        for at in range(block + 7, block + 4096, 499):  # header bytes and payload bytes alike
            flip_bit(path, at, 5)
        reasons, outs = _load(s, keys)
        for i, (k, r, o) in enumerate(zip(keys, reasons, outs)):
            e = entries[k]
            flipped = any(e.offset <= at < e.offset + e.record_len for at in range(block + 7, block + 4096, 499))
            if flipped:
                assert r is Reason.CORRUPT and (o == 0xAA).all()
            else:
                assert r is Reason.OK and torch.equal(o, make_payload(f"s{i}", SMALL))
        assert sum(r is Reason.CORRUPT for r in reasons) >= 3


def test_truncation_inside_an_extent_fails_the_records_past_the_cut(tmp_path, read_path) -> None:
    root = str(tmp_path)
    keys = _small_batch(root)
    with DiskStore(root) as s:
        entries = [r.entry for r in s.records(keys)]
        cut = entries[40].offset + HEADER_BYTES + 10
        os.truncate(segment_path(root, entries[0].segment), cut)
        reasons, outs = _load(s, keys)
        assert reasons[:40] == [Reason.OK] * 40 and reasons[40:] == [Reason.CORRUPT] * 24
        assert all((o == 0xAA).all() for o in outs[40:])
        assert s.records([keys[40]])[0].entry.quarantine is QuarantineReason.SEGMENT_TRUNCATED


def test_deleted_segment_fails_every_record_of_it_as_missing(tmp_path, read_path) -> None:
    root = str(tmp_path)
    keys = _small_batch(root)
    with DiskStore(root) as s:
        os.unlink(segment_path(root, s.records(keys[:1])[0].entry.segment))
        reasons, _ = _load(s, keys)
        assert reasons == [Reason.MISSING] * 64


def test_rebuild_recovers_every_record_of_extents_and_skips_a_damaged_one(tmp_path) -> None:
    root = str(tmp_path)
    keys = _small_batch(root)
    with DiskStore(root) as s:
        e = s.records(keys[7:8])[0].entry
    flip_bit(segment_path(root, e.segment), e.payload_offset + 3, 1)
    os.rename(os.path.join(root, "index.lmdb"), os.path.join(root, "old-index"))
    report = rebuild_index(root)
    assert report.records_after == 63 and report.corrupt_extents == 1 and report.namespaces_after == 1
    with DiskStore(root) as s:
        reasons, _outs = _load(s, keys)
    assert reasons == [Reason.OK] * 7 + [Reason.MISSING] + [Reason.OK] * 56


# ----------------------------------------------------------------- format v1 stores (written by kvtier before v2)


def _v1_store(tmp_path: Path) -> tuple[str, dict]:
    with tarfile.open(os.path.join(DATA, "v1-store.tar.gz")) as tar:
        tar.extractall(tmp_path, filter="data")
    with open(os.path.join(DATA, "v1-store.json")) as f:
        return str(tmp_path / "store"), json.load(f)


def _v1_requests(manifest: dict) -> list[tuple[ObjectKey, torch.Tensor, bytes, str]]:
    ns = VersionKey(*manifest["version_key"]).namespace
    return [
        (
            ObjectKey(ns, bytes.fromhex(r["block_hash"]), r["group"], CacheForm(r["form"])),
            torch.full((r["payload_len"],), 0xAA, dtype=torch.uint8),
            bytes.fromhex(r["layout_digest"]),
            r["xxh3_128"],
        )
        for r in manifest["records"]
    ]


def _check_v1_bytes(store: DiskStore, manifest: dict) -> None:
    reqs = _v1_requests(manifest)
    assert store.load_into([LoadRequest(k, o, d) for k, o, d, _ in reqs]) == [Reason.OK] * len(reqs)
    assert [xxhash.xxh3_128_hexdigest(o.numpy().tobytes()) for _, o, _, _ in reqs] == [h for *_, h in reqs]


def test_a_v1_store_is_read_verified_and_written_to_by_v2(tmp_path) -> None:
    root, manifest = _v1_store(tmp_path)
    with DiskStore(root, readonly=True) as s:
        assert s.format_version() == 1
        _check_v1_bytes(s, manifest)
    with DiskStore(root, writer=True) as s:
        assert s.format_version() == 2  # an older kvtier now refuses it rather than misreading v2 records
        keys = [k for k, *_ in _v1_requests(manifest)]
        assert all(v.reason is Reason.OK for v in s.verify_many(keys))
        new = make_key(VersionKey(*manifest["version_key"]).namespace, "new")
        s.store(new, make_payload("new", 5000), DIGEST)
        _check_v1_bytes(s, manifest)
        assert current(s) and kept(s) == walked(s)  # its writer's open counted the namespace rows
        before = kept(s)
        assert s.relocate([keys]) == [len(keys)]  # compaction moves v1 records into v2 extents
        assert {r.entry.record_version for r in s.records(keys)} == {2}
        _check_v1_bytes(s, manifest)
        assert (
            current(s)
            and kept(s) == walked(s)
            and sum(b for _, b in kept(s).values()) < sum(b for _, b in before.values())
        )  # a v1 record shrinks as it moves


def test_a_v1_store_is_rebuilt_from_its_segments(tmp_path) -> None:
    root, manifest = _v1_store(tmp_path)
    os.rename(os.path.join(root, "index.lmdb"), os.path.join(root, "gone"))
    report = rebuild_index(root)
    assert report.records_after == len(manifest["records"]) and report.namespaces_after == 1
    with DiskStore(root) as s:
        _check_v1_bytes(s, manifest)
        assert current(s) and kept(s) == walked(s)  # the rebuild wrote the namespace rows


# ----------------------------------------------------------------- compaction while the LMDB map grows (issue 18)

_GROW = """
import sys
from kvtier.store import DiskStore
with DiskStore(sys.argv[1]) as s:
    s.put_meta_doc("rollout", {"filler": "x" * (96 << 20)})  # past the 64 MiB map the other process has mapped
"""


def test_compaction_completes_while_another_process_grows_the_map(tmp_path, monkeypatch) -> None:
    root = str(tmp_path)
    keys = _small_batch(root, segment_bytes=1 << 20)
    with DiskStore(root) as s:
        real = reader_mod.Reader.scan

        def grow_then_read(self, txn, items, visit, **kw):  # the map grows while relocation has its records in hand
            subprocess.run([sys.executable, "-c", _GROW, root], env=subprocess_env(), check=True, timeout=120)
            return real(self, txn, items, visit, **kw)

        monkeypatch.setattr(reader_mod.Reader, "scan", grow_then_read)
        done: list[int] = []
        t = threading.Thread(target=lambda: done.append(s.relocate([keys])), daemon=True)
        t.start()
        t.join(180)
        assert not t.is_alive(), "relocate hung while the map grew"
        monkeypatch.undo()
        assert done == [[64]]
        assert s.index.env.info()["map_size"] > 64 << 20  # this process adopted the grown map mid-compaction
        reasons, _outs = _load(s, keys)
        assert reasons == [Reason.OK] * 64


@pytest.fixture
def writes(monkeypatch) -> list[tuple[int, int]]:
    """(offset, length) of every write to a segment file, in order."""
    seen: list[tuple[int, int]] = []
    real = SegmentFile.pwrite_all

    def counted(self, data, offset):
        seen.append((offset, len(data)))
        return real(self, data, offset)

    monkeypatch.setattr(SegmentFile, "pwrite_all", counted)
    return seen


def _one_after_another(writes: list[tuple[int, int]]) -> bool:
    return all(a + n == b for (a, n), (b, _) in itertools.pairwise(writes))


def test_compaction_writes_its_copies_in_pieces_one_after_another(tmp_path, writes) -> None:
    """A relocation's extent goes to the disk in BACKGROUND_IO_BYTES pieces, in order; a store's in one write."""
    root, size = str(tmp_path), (3 << 20) // 2
    with DiskStore(root, StoreConfig(), writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"b{i}") for i in range(3)]
        s.store_many([(k, make_payload(f"b{i}", size), DIGEST) for i, k in enumerate(keys)])
        assert len(writes) == 1 and writes[0][1] >= 3 * size  # the engine's store: one extent, one write
    with DiskStore(root) as s:
        before = {r.entry.segment for r in s.records(keys)}
        writes.clear()
        assert s.relocate([keys]) == [3]
        assert {r.entry.segment for r in s.records(keys)}.isdisjoint(before)
        assert len(writes) > 4 and all(n <= BACKGROUND_IO_BYTES for _, n in writes)
        assert _one_after_another(writes)
        reasons, outs = _load(s, keys, size)
        assert reasons == [Reason.OK] * 3
        assert all(torch.equal(o, make_payload(f"b{i}", size)) for i, o in enumerate(outs))


def test_a_writer_with_write_piece_bytes_writes_each_extent_in_pieces(tmp_path, writes) -> None:
    """`write_piece_bytes` cuts each extent's write into pieces of at most that size, in order, and the records read
    back; the extents themselves are laid out as without it."""
    piece, size = 256 << 10, (3 << 20) // 2
    at_once = _small_batch(str(tmp_path / "once"), 3, size=size)
    extents = list(writes)
    writes.clear()
    keys = _small_batch(str(tmp_path / "pieces"), 3, size=size, write_piece_bytes=piece)
    assert len(extents) == 1 and len(writes) == -(-extents[0][1] // piece)
    assert all(n <= piece for _, n in writes) and _one_after_another(writes)
    assert sum(n for _, n in writes) == extents[0][1] and writes[0][0] == extents[0][0]
    with DiskStore(str(tmp_path / "pieces")) as s:
        reasons, outs = _load(s, keys, size)
    assert reasons == [Reason.OK] * 3 and at_once == keys
    assert all(torch.equal(o, make_payload(f"s{i}", size)) for i, o in enumerate(outs))


def test_write_piece_bytes_must_be_aligned() -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        StoreConfig(write_piece_bytes=1000)


# ----------------------------------------------------------------- the device checksum and the GDS paths


def test_device_checksum_catches_every_single_bit_flip_and_swaps() -> None:
    data = make_payload("dsum", 4099)
    base = device_checksum(data)
    assert base == device_checksum(data.clone())
    for at in range(0, 4099, 97):
        for bit in (0, 7):
            d = data.clone()
            d[at] ^= 1 << bit
            assert device_checksum(d) != base
    swapped = data.clone()
    swapped[:4], swapped[4:8] = data[4:8].clone(), data[:4].clone()
    assert torch.equal(swapped, data) or device_checksum(swapped) != base
    assert device_checksum(torch.zeros(8, dtype=torch.uint8)) != device_checksum(torch.zeros(12, dtype=torch.uint8))
    assert device_checksum(data[1:]) == device_checksum(data[1:].clone())  # unaligned views


class CpuAsDevice(PosixBackend):
    """Stands in for GDS (no GPU here): 'device' tensors are cpu tensors, moved with plain pread/pwrite."""

    gpu_direct = True

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.device_reads = 0
        self.device_writes = 0

    def device_io(self, t: torch.Tensor) -> bool:
        return True

    def read_device(self, seg: SegmentFile, out: torch.Tensor, offset: int) -> int:
        self.device_reads += 1
        return seg.pread_into(memoryview(out.numpy()), offset)

    def write_device(self, seg: SegmentFile, data: torch.Tensor, offset: int) -> None:
        self.device_writes += 1
        seg.pwrite_all(memoryview(data.numpy()), offset)


@pytest.fixture
def cpu_as_device(monkeypatch) -> CpuAsDevice:
    backend = CpuAsDevice()
    monkeypatch.setattr("kvtier.store.store.select_backend", lambda *a, **k: backend)
    return backend


def test_device_path_writes_and_reads_check_the_device_sum_only(tmp_path, cpu_as_device) -> None:
    root = str(tmp_path)
    keys = _small_batch(root)
    assert cpu_as_device.device_writes == 1  # the whole extent, one write from "device" memory
    with DiskStore(root) as s:
        entries = [r.entry for r in s.records(keys)]
        assert all(e.flags == Flags.DEVSUM and e.payload_checksum == bytes(16) for e in entries)
        reasons, outs = _load(s, keys)
        assert reasons == [Reason.OK] * 64 and cpu_as_device.device_reads == 64
        assert all(torch.equal(o, make_payload(f"s{i}", SMALL)) for i, o in enumerate(outs))
        flip_bit(segment_path(root, entries[3].segment), entries[3].payload_offset + 17, 2)
        reasons, _ = _load(s, keys[:8])
        assert reasons == [Reason.OK] * 3 + [Reason.CORRUPT] + [Reason.OK] * 4
        assert s.records(keys[3:4])[0].entry.quarantine is QuarantineReason.PAYLOAD


def test_host_reads_check_device_sum_records_too(tmp_path, cpu_as_device, monkeypatch) -> None:
    root = str(tmp_path)
    keys = _small_batch(root)
    monkeypatch.setattr(CpuAsDevice, "device_io", lambda self, t: False)  # a host that reads them without GDS
    with DiskStore(root) as s:
        e = s.records(keys[9:10])[0].entry
        flip_bit(segment_path(root, e.segment), e.payload_offset, 0)
        reasons, outs = _load(s, keys)
    assert cpu_as_device.device_reads == 0
    assert reasons == [Reason.OK] * 9 + [Reason.CORRUPT] + [Reason.OK] * 54
    assert torch.equal(outs[0], make_payload("s0", SMALL))


def test_device_checksums_on_records_both_sums(tmp_path) -> None:
    root = str(tmp_path)
    keys = _small_batch(root, device_checksums="on")
    with DiskStore(root) as s:
        e = s.records(keys[:1])[0].entry
        assert e.flags == Flags.XXH3 | Flags.DEVSUM
        assert e.device_checksum == device_checksum(make_payload("s0", SMALL))
