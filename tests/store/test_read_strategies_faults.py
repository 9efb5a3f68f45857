"""Every fault case, through every submit strategy: the answer, the quarantine and the bytes left in each target.

The store holds one record per case (FAULTS): good small and large records (a large one with an unaligned tail,
one into an unaligned target), a flipped header byte and a flipped payload byte in small, large and compressed
records, an index entry that no longer matches its header, a request with the wrong layout digest or the wrong
length, a retired namespace, a segment cut inside a record and a segment unlinked; a v1 store is read the same
way. Each case is loaded through each strategy the store can choose (native AIO, threads over O_DIRECT, buffered
segments, and GDS stood in on cpu for device targets, `support.read_paths.CpuGds`), from a fresh copy of the
damaged store, and checked against the model below; then the strategies are checked against each other: the same
reasons, the same quarantined keys, and (native AIO and threads over the same O_DIRECT alignment) the same bytes
in every target. These pin what the read
path answers, whichever way it reads, so any rewrite of it must keep them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tarfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import xxhash

from kvtier.core import CacheForm, Reason, VersionKey
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DiskStore, IndexEntry, QuarantineReason, StoreConfig, aio, encode_key, packed
from support.corrupt import flip_bit, segment_path
from support.read_paths import CpuGds, replace_entry
from support.store_helpers import DIGEST, VK, make_key, make_payload, slot_like

FILL = 0xAA
OK, QR = Reason.OK, QuarantineReason


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    size: int
    reason: Reason
    quarantine: QuarantineReason | None = None
    zstd: bool = False  # stored compressed (an SWA record of a namespace that compresses SWA)
    session: int = 0  # 0: the main segment; 1: a segment cut inside its second record; 2: a segment unlinked
    device: bool = False  # under GDS, its target stands for device memory


FAULTS = [
    Case("small", 1000, OK, device=True),
    Case("small-2", 300, OK),
    Case("large", 100_000, OK, device=True),
    Case("large-tail", 20_003, OK),  # a large payload whose length is no multiple of the alignment
    Case("large-unaligned-target", 100_000, OK),
    Case("header-small", 2000, Reason.CORRUPT, QR.HEADER),
    Case("payload-small", 2200, Reason.CORRUPT, QR.PAYLOAD),
    Case("payload-large", 6000, Reason.CORRUPT, QR.PAYLOAD, device=True),
    Case("header-large", 100_000, Reason.CORRUPT, QR.HEADER),
    Case("payload-large-tail", 20_003, Reason.CORRUPT, QR.PAYLOAD, device=True),
    Case("zstd", 50_000, OK, zstd=True, device=True),
    Case("payload-zstd", 50_000, Reason.CORRUPT, QR.PAYLOAD, zstd=True),
    Case("created", 1500, Reason.CORRUPT, QR.HEADER_MISMATCH),
    Case("wrong-digest", 1200, Reason.ABI_MISMATCH),
    Case("wrong-length", 1300, Reason.ABI_MISMATCH),
    Case("stale-namespace", 1400, Reason.STALE_VERSION),
    Case("before-cut", 3000, OK, session=1),
    Case("cut", 30_000, Reason.CORRUPT, QR.SEGMENT_TRUNCATED, session=1, device=True),
    Case("after-cut", 3000, Reason.CORRUPT, QR.SEGMENT_TRUNCATED, session=1),
    Case("unlinked", 2500, Reason.MISSING, QR.SEGMENT_MISSING, session=2),
    Case("unlinked-2", 700, Reason.MISSING, QR.SEGMENT_MISSING, session=2),
]
STRATEGIES = ["aio", "threads", "buffered", "gds"]
STALE_VK = VK.bumped(compression_version="comp-old")


def _payload(c: Case) -> torch.Tensor:
    if c.zstd:  # compressible: zstd stores it in fewer bytes
        return torch.arange(c.size, dtype=torch.int64).div(97, rounding_mode="floor").to(torch.uint8)
    return make_payload(c.name, c.size)


def _key(ns: bytes, stale: bytes, c: Case) -> ObjectKey:
    if c.name == "stale-namespace":
        return make_key(stale, c.name)
    return make_key(ns, c.name, "swa", CacheForm.SWA) if c.zstd else make_key(ns, c.name)


@dataclasses.dataclass(frozen=True)
class Damaged:
    root: str
    keys: list[ObjectKey]
    entries: list[IndexEntry]  # as written


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Damaged:
    """A store with every case of FAULTS written (device checksums on, as a GDS host writes) and then damaged."""
    root = str(tmp_path_factory.mktemp("strategies") / "store")
    cfg = StoreConfig(io_backend="odirect", device_checksums="on")
    keys: list[ObjectKey] = []
    for session in range(3):  # a new writer starts a new segment
        with DiskStore(root, cfg, writer=True) as s:
            ns = s.register_namespace(VK, codecs={CacheForm.SWA: "zstd"})
            stale = s.register_namespace(STALE_VK)
            todo = [c for c in FAULTS if c.session == session]
            s.store_many([(_key(ns, stale, c), _payload(c), DIGEST) for c in todo])
            keys += [_key(ns, stale, c) for c in todo]
    order = [c for s in range(3) for c in FAULTS if c.session == s]
    with DiskStore(root, cfg) as s:
        by_key = {r.key: r.entry for r in s.iter_records(limit=100)}
    entries = {c.name: by_key[k] for c, k in zip(order, keys)}
    keyed = {c.name: k for c, k in zip(order, keys)}
    assert entries["zstd"].stored_len < entries["zstd"].payload_len  # really stored compressed
    for c in FAULTS:
        e = entries[c.name]
        path = segment_path(root, e.segment)
        if c.quarantine is QR.HEADER:
            flip_bit(path, e.offset + 40, 3)  # inside the namespace field
        elif c.quarantine is QR.PAYLOAD:
            flip_bit(path, e.payload_offset + e.stored_len - 1, 5)  # the last byte: a large one's unaligned tail
    with DiskStore(root, cfg, writer=True) as s:
        replace_entry(s, keyed["created"], created=entries["created"].created + 1.0)
        assert s.retire_namespace(STALE_VK.namespace)
    cut = entries["cut"]
    os.truncate(segment_path(root, cut.segment), cut.offset + cut.record_len // 2)
    os.unlink(segment_path(root, entries["unlinked"].segment))
    return Damaged(root, [keyed[c.name] for c in FAULTS], [entries[c.name] for c in FAULTS])


@contextlib.contextmanager
def _store(root: str, strategy: str):
    """The store opened to read through `strategy` (native AIO refused for `threads`; a GDS stand-in for `gds`)."""
    no_aio = mock.patch.object(aio, "acquire", lambda: None) if strategy == "threads" else contextlib.nullcontext()
    cfg = StoreConfig(io_backend="buffered" if strategy == "buffered" else "odirect")
    with no_aio, DiskStore(root, cfg, writer=True) as s:
        if strategy == "gds":
            s.backend = s._ctx.backend = CpuGds(s.backend.direct_align)
        yield s


def _targets(cases: list[Case]) -> list[torch.Tensor]:
    outs = []
    for c in cases:
        n = c.size + 1 if c.name == "wrong-length" else c.size
        outs.append(slot_like(n + 1, FILL)[1:] if c.name == "large-unaligned-target" else slot_like(n, FILL))
    return outs


def _on_disk(root: str, e: IndexEntry) -> tuple[torch.Tensor, int] | None:
    """The payload's bytes as they lie in the damaged segment (zero past its end) and how many of them the file
    holds; None where the segment is gone."""
    path = segment_path(root, e.segment)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        f.seek(e.payload_offset)
        data = f.read(e.stored_len)
    return torch.frombuffer(bytearray(data.ljust(e.stored_len, b"\0")), dtype=torch.uint8), len(data)


def _load(d: Damaged, tmp_path: Path, strategy: str, picks: list[int]):
    root = str(tmp_path / strategy)
    shutil.copytree(d.root, root)
    cases = [FAULTS[i] for i in picks]
    outs = _targets(cases)
    digests = [b"W" * 16 if c.name == "wrong-digest" else DIGEST for c in cases]
    with _store(root, strategy) as s:
        if strategy == "gds":
            s.backend.device.update(o.data_ptr() for c, o in zip(cases, outs) if c.device)
        reasons = s.load_into([LoadRequest(d.keys[i], o, dg) for i, o, dg in zip(picks, outs, digests)])
        states = {r.key: r.entry.quarantine for r in s.iter_records(limit=100)}
        device_reads = s.backend.device_reads if strategy == "gds" else 0
    return reasons, outs, [states.get(k) for k in d.keys], device_reads, root


@pytest.fixture
def native_aio() -> None:
    ctx = aio.acquire()
    if ctx is None:
        pytest.skip("native AIO is not available on this machine")
    aio.release(ctx)


ORDERS = {
    "written": list(range(len(FAULTS))),
    "reversed": list(reversed(range(len(FAULTS)))),
    "twice": [i for i in range(len(FAULTS)) for _ in (0, 1)],  # each asked twice: runs whose records share bytes
}


@pytest.mark.parametrize("order", ORDERS)
def test_every_strategy_answers_every_fault_case_as_the_model(damaged, tmp_path, native_aio, order) -> None:
    picks = ORDERS[order]
    seen = {}
    for strategy in STRATEGIES:
        reasons, outs, states, device_reads, root = _load(damaged, tmp_path, strategy, picks)
        for i, reason, out in zip(picks, reasons, outs):
            c = FAULTS[i]
            assert reason is c.reason, (strategy, c.name, reason)
            if reason is OK:
                assert torch.equal(out, _payload(c)), (strategy, c.name)
                continue
            # A failed load leaves its target as it was, or holding bytes of the record's own payload as read
            # (a payload read straight into its target): never another record's bytes, never a decoded guess.
            disk = _on_disk(root, damaged.entries[i])
            touched = out != FILL
            if c.zstd or disk is None or c.name.startswith("wrong-"):
                assert not touched.any(), (strategy, c.name)
            else:
                on_disk, _ = disk
                assert torch.equal(out[touched], on_disk[: out.numel()][touched]), (strategy, c.name)
        asked = set(picks)
        for i, (c, state) in enumerate(zip(FAULTS, states)):
            assert state is (c.quarantine if i in asked else None), (strategy, c.name, state)
        if strategy == "gds":  # each good device target of a GDS-ready record read by GDS
            assert device_reads == sum(1 for i in picks if FAULTS[i].device and not FAULTS[i].zstd), device_reads
        seen[strategy] = (reasons, states, outs)
        shutil.rmtree(root)
    base_reasons, base_states, base_outs = seen["aio"]
    for strategy in STRATEGIES[1:]:
        reasons, states, _ = seen[strategy]
        assert reasons == base_reasons and states == base_states, strategy
    # The same bytes in every target where the alignment is the same (a buffered segment takes a payload straight
    # into a target at any address and length, O_DIRECT only its aligned bulk) and no record is asked twice (which
    # of the two targets a payload goes straight into is the strategy's choice): the model above holds for all.
    if len(set(picks)) == len(picks):
        for i, a, b in zip(picks, base_outs, seen["threads"][2]):
            assert torch.equal(a, b), FAULTS[i].name


# ----------------------------------------------------------------- format v1 records

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")  # a real v1 store written by c307a27


def _v1_damaged(tmp_path) -> tuple[str, list[dict], list[ObjectKey]]:
    """The v1 store unpacked, its first record's header and second record's payload each with a bit flipped: its
    root, the manifest's records and their keys."""
    with tarfile.open(os.path.join(DATA, "v1-store.tar.gz")) as tar:
        tar.extractall(tmp_path, filter="data")
    with open(os.path.join(DATA, "v1-store.json")) as f:
        manifest = json.load(f)
    root = str(tmp_path / "store")
    ns = VersionKey(*manifest["version_key"]).namespace
    recs = manifest["records"]
    keys = [ObjectKey(ns, bytes.fromhex(r["block_hash"]), r["group"], CacheForm(r["form"])) for r in recs]
    with DiskStore(root, readonly=True) as s:
        entries = [r.entry for r in s.records(keys)]
    flip_bit(segment_path(root, entries[0].segment), entries[0].offset + 40, 1)  # a header byte
    flip_bit(segment_path(root, entries[1].segment), entries[1].payload_offset + 7, 2)  # a payload byte
    return root, recs, keys


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_v1_records_through_every_strategy(tmp_path, native_aio, strategy) -> None:
    root, recs, keys = _v1_damaged(tmp_path)
    outs = [torch.full((r["payload_len"],), FILL, dtype=torch.uint8) for r in recs]
    digests = [bytes.fromhex(r["layout_digest"]) for r in recs]
    served: list[tuple[list[bytes], list]] = []  # what the batch pipeline answered: its hits and its named faults
    finish = packed.PackedLoad.finish

    def spy(self):
        served.append(finish(self))
        return served[-1]

    with _store(root, strategy) as s, mock.patch.object(packed.PackedLoad, "finish", spy):
        if strategy == "gds":
            s.backend.device.update(o.data_ptr() for o in outs)  # v1 records are not GDS-ready: host reads
        reasons = s.load_into([LoadRequest(k, o, dg) for k, o, dg in zip(keys, outs, digests)])
        states = [r.entry.quarantine for r in s.records(keys)]
        if strategy == "gds":
            assert s.backend.device_reads == 0
    assert reasons == [Reason.CORRUPT, Reason.CORRUPT] + [OK] * (len(recs) - 2)
    assert states[:2] == [QR.HEADER, QR.PAYLOAD] and states[2:] == [None] * (len(recs) - 2)
    assert all(xxhash.xxh3_128_hexdigest(o.numpy().tobytes()) == r["xxh3_128"] for o, r in zip(outs[2:], recs[2:]))
    assert all((o == FILL).all() for o in outs[:2])  # v1 payloads go through the bounce buffer: never half-written
    # host and device targets alike: every v1 record served, or its fault named, by the batch pipeline
    assert sorted(k for hits, _ in served for k in hits) == sorted(encode_key(k) for k in keys[2:])
    named = sorted((i, exc.reason) for _, faults in served for i, exc in faults)
    assert named == [(0, QR.HEADER), (1, QR.PAYLOAD)]


# ----------------------------------------------------------------- scans: the verifier's checks and compaction's reads

# What a verify finds per case: the record's own damage (a load's wrong digest, wrong length or retired namespace are
# the request's or the namespace's, not the record's: its bytes are good).
_SCAN_FAULT = {c.name: c.quarantine if c.reason is not Reason.STALE_VERSION else None for c in FAULTS}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_verify_and_relocate_name_every_fault_through_every_strategy(damaged, tmp_path, native_aio, strategy) -> None:
    root = str(tmp_path / strategy)
    shutil.copytree(damaged.root, root)
    with _store(root, strategy) as s:
        found = s.verify_many(damaged.keys, apply=False)  # the verdicts only: nothing quarantined yet
        assert [r.failure for r in found] == [_SCAN_FAULT[c.name] for c in FAULTS], strategy
        assert [r.reason for r in found] == [
            OK if q is None else q.miss_reason for q in (_SCAN_FAULT[c.name] for c in FAULTS)
        ]
        assert all(r.entry.quarantine is None for r in s.records(damaged.keys))
        good = [k for k, c in zip(damaged.keys, FAULTS) if _SCAN_FAULT[c.name] is None]
        assert s.relocate([damaged.keys]) == [len(good)]  # the good ones moved, the bad ones quarantined
        states = {r.key: r.entry for r in s.records(damaged.keys)}
        assert [states[k].quarantine for k in damaged.keys] == [_SCAN_FAULT[c.name] for c in FAULTS]
        moved = [states[k] for k in good]
        assert all(
            (e.segment, e.offset) != (old.segment, old.offset)
            for e, old in zip(moved, (e for e, c in zip(damaged.entries, FAULTS) if _SCAN_FAULT[c.name] is None))
        )
        # the moved bytes are the written ones: a load of each good record (the wrong digest and length asked right)
        ok = [(k, c) for k, c in zip(damaged.keys, FAULTS) if _SCAN_FAULT[c.name] is None]
        outs = [slot_like(c.size, FILL) for _, c in ok]
        live = [c.reason is not Reason.STALE_VERSION for _, c in ok]
        reasons = s.load_into([LoadRequest(k, o, DIGEST) for (k, _), o in zip(ok, outs)])
        assert reasons == [OK if alive else Reason.STALE_VERSION for alive in live]
        for (_, c), o, alive in zip(ok, outs, live):
            if alive:
                assert torch.equal(o, _payload(c)), c.name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_verify_names_v1_faults_through_every_strategy(tmp_path, native_aio, strategy) -> None:
    root, recs, keys = _v1_damaged(tmp_path)
    with _store(root, strategy) as s:
        found = s.verify_many(keys)
        assert [r.failure for r in found] == [QR.HEADER, QR.PAYLOAD] + [None] * (len(recs) - 2)
        assert [r.entry.quarantine for r in s.records(keys)] == [QR.HEADER, QR.PAYLOAD] + [None] * (len(recs) - 2)
