"""Small records through the batch pipeline (kvtier.store.packed), and large ones among them read straight into their
targets: the same answers and bytes through native AIO and through threads, every record it finds damaged named (and
quarantined) on the bytes already read, what it does not read named from the index, bounce memory bounded by its
chunks."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core import CacheForm, Reason
from kvtier.core.loadbatch import LoadBatch, TargetGroup
from kvtier.core.tier import LoadRequest
from kvtier.store import (
    DiskStore,
    QuarantineReason,
    RecordState,
    StoreRequestError,
    aio,
    packed,
)
from kvtier.store import io as io_mod
from kvtier.store.extent import BACKGROUND_IO_BYTES
from kvtier.store.io import BufferPool
from kvtier.store.record import HEADER_BYTES
from support.corrupt import flip_bit, segment_path
from support.read_paths import replace_entry
from support.store_helpers import DIGEST, VK, make_key, make_payload, slot_like

N = 64
SIZES = [random.Random(i).randrange(1, 4096) for i in range(N)]  # every one small: < LARGE_PAYLOAD


@pytest.fixture(autouse=True)
def native_aio() -> None:
    ctx = aio.acquire()
    if ctx is None:
        pytest.skip("native AIO is not available on this machine: loads read with threads only")
    aio.release(ctx)


def _populate(root: str, sizes: list[int], tag: str = "p") -> list:
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"{tag}{i}") for i in range(len(sizes))]
        s.store_many([(k, make_payload(f"{tag}{i}", n), DIGEST) for i, (k, n) in enumerate(zip(keys, sizes))])
    return keys


@pytest.fixture
def small(tmp_path):
    root = str(tmp_path / "store")
    return root, _populate(root, SIZES)


@pytest.fixture
def served(monkeypatch) -> list[int]:
    """How many records each load's packed path served."""
    counts: list[int] = []
    real = packed.PackedLoad.finish

    def finish(self):
        out = real(self)
        counts.append(len(out[0]))  # the keys it served
        return out

    monkeypatch.setattr(packed.PackedLoad, "finish", finish)
    return counts


def _load(store: DiskStore, keys, sizes, digest: bytes = DIGEST) -> tuple[list[Reason], list[torch.Tensor]]:
    outs = [torch.full((n,), 0xAA, dtype=torch.uint8) for n in sizes]
    return store.load_into([LoadRequest(k, o, digest) for k, o in zip(keys, outs)]), outs


def test_small_records_are_served_by_the_packed_path(small, served) -> None:
    root, keys = small
    order = list(range(N))
    random.Random(7).shuffle(order)
    with DiskStore(root) as s:
        reasons, outs = _load(s, [keys[i] for i in order], [SIZES[i] for i in order])
    assert reasons == [Reason.OK] * N
    assert all(torch.equal(o, make_payload(f"p{i}", SIZES[i])) for i, o in zip(order, outs))
    assert served == [N]


def test_compressed_records_are_served_and_decoded_by_the_packed_path(tmp_path, served) -> None:
    root = str(tmp_path / "store")
    sizes = [300, 3000, 50_000, 200_000]  # stored compressed in fewer bytes; the larger targets are aligned slots
    plain = [torch.arange(n, dtype=torch.int64).div(61 + n % 7, rounding_mode="floor").to(torch.uint8) for n in sizes]
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK, codecs={CacheForm.SWA: "zstd"})
        keys = [make_key(ns, f"z{i}", "swa", CacheForm.SWA) for i in range(len(sizes))]
        s.store_many([(k, p, DIGEST) for k, p in zip(keys, plain)])
        assert all(r.entry.stored_len < r.entry.payload_len for r in s.records(keys))
    with DiskStore(root) as s:
        outs = [slot_like(n) for n in sizes]
        assert s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]) == [Reason.OK] * len(sizes)
    assert all(torch.equal(o, p) for o, p in zip(outs, plain))
    assert served == [len(sizes)]  # every one read, checked and decoded by the packed path


@pytest.mark.parametrize(
    "where, quarantined",
    [
        ("payload", QuarantineReason.PAYLOAD),
        ("header", QuarantineReason.HEADER),  # a header field: its checksum no longer matches
        ("header checksum", QuarantineReason.HEADER),
    ],
)
def test_a_damaged_small_record_fails_alone_and_is_quarantined(small, served, where, quarantined) -> None:
    root, keys = small
    victim = 17
    with DiskStore(root) as s:
        e = s.records([keys[victim]])[0].entry
        at = {
            "payload": e.payload_offset + SIZES[victim] - 1,
            "header": e.offset + 60,
            "header checksum": e.offset + 155,
        }
        flip_bit(segment_path(root, e.segment), at[where], 3)
        reasons, outs = _load(s, keys, SIZES)
        assert served == [N - 1]  # the damaged one named, not served
        assert reasons[victim] is Reason.CORRUPT
        assert [r for i, r in enumerate(reasons) if i != victim] == [Reason.OK] * (N - 1)
        assert all(torch.equal(o, make_payload(f"p{i}", SIZES[i])) for i, o in enumerate(outs) if i != victim)
        entry = s.records([keys[victim]])[0].entry
        assert entry.state is RecordState.QUARANTINED and entry.quarantine is quarantined


def test_a_record_of_another_key_in_its_place_is_refused(small) -> None:
    """The header names its key: another record's bytes (a stale read) never pass for this one's."""
    root, keys = small
    with DiskStore(root) as s:
        a, b = (s.records([keys[i]])[0].entry for i in (3, 4))
        path = segment_path(root, a.segment)
        fd = os.open(path, os.O_RDWR)
        try:  # record 4's header over record 3's (lengths differ: its fields are 4's)
            os.pwrite(fd, os.pread(fd, HEADER_BYTES, b.offset), a.offset)
        finally:
            os.close(fd)
        reasons, _ = _load(s, keys, SIZES)
    assert reasons[3] is Reason.CORRUPT and reasons[4] is Reason.OK


def test_a_truncated_extent_fails_the_records_past_the_cut(small, served) -> None:
    root, keys = small
    with DiskStore(root) as s:
        entries = [s.records([k])[0].entry for k in keys]
        cut = entries[N // 2].offset + HEADER_BYTES + 1
        os.truncate(segment_path(root, entries[0].segment), cut)
    with DiskStore(root) as s:
        reasons, _ = _load(s, keys, SIZES)
        for i, (e, r) in enumerate(zip(entries, reasons)):
            assert r is (Reason.OK if e.offset + e.record_len <= cut else Reason.CORRUPT), i
        assert served == [sum(e.offset + e.record_len <= cut for e in entries)]
        assert s.records([keys[-1]])[0].entry.quarantine is QuarantineReason.SEGMENT_TRUNCATED


def test_a_deleted_segment_is_a_miss_for_each_record(small) -> None:
    root, keys = small
    with DiskStore(root) as s:
        os.unlink(segment_path(root, s.records([keys[0]])[0].entry.segment))
        reasons, outs = _load(s, keys, SIZES)
        assert reasons == [Reason.MISSING] * N and all((o == 0xAA).all() for o in outs)
        assert {r.entry.quarantine for r in s.iter_records()} == {QuarantineReason.SEGMENT_MISSING}


def test_an_uncompressed_entry_whose_stored_length_is_not_its_payloads_is_a_fault_never_read(
    small, monkeypatch
) -> None:
    """An index entry (sealed, so it parses) that says stored as is with a stored length other than the payload's: no
    writer makes one, so it is quarantined `index_value` from the index alone, nothing read, its target untouched; the
    records beside it load."""
    root, keys = small
    with DiskStore(root, writer=True) as s:
        replace_entry(s, keys[3], stored_len=s.records(keys[3:4])[0].entry.stored_len + 1)
        read: list[int] = []
        real_submit = aio.AioContext.submit
        monkeypatch.setattr(aio.AioContext, "submit", lambda self, ops: read.append(len(ops)) or real_submit(self, ops))
        reasons, outs = _load(s, keys[3:4], SIZES[3:4])
        assert reasons == [Reason.CORRUPT] and (outs[0] == 0xAA).all() and read == []
        assert s.records(keys[3:4])[0].entry.quarantine is QuarantineReason.INDEX_VALUE
        reasons, outs = _load(s, keys[:6], SIZES[:6])
        assert reasons == [Reason.OK] * 3 + [Reason.CORRUPT] + [Reason.OK] * 2 and read


def test_more_is_called_once_and_answered_after_the_first(small, served) -> None:
    root, keys = small
    outs = [torch.empty(n, dtype=torch.uint8) for n in SIZES]
    reqs = [LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]
    missing = LoadRequest(make_key(b"\0" * 16, "nowhere"), torch.empty(8, dtype=torch.uint8), DIGEST)
    calls: list[int] = []

    def more():
        calls.append(1)
        return [missing, *reqs[10:]]

    with DiskStore(root) as s:
        reasons = s.load_into(reqs[:10], more)
    assert calls == [1]
    assert reasons == [Reason.OK] * 10 + [Reason.MISSING] + [Reason.OK] * (N - 10)
    assert all(torch.equal(o, make_payload(f"p{i}", SIZES[i])) for i, o in enumerate(outs))
    assert served == [N]


def test_a_load_whose_first_requests_all_miss_has_more_served_by_the_packed_path(small, served) -> None:
    """First requests that are all misses send no read: `more` is called at once, and what it brings is the batch
    pipeline's."""
    root, keys = small
    outs = [torch.empty(n, dtype=torch.uint8) for n in SIZES]
    nowhere = [make_key(b"\0" * 16, f"nowhere{i}") for i in range(3)]
    first = [LoadRequest(k, torch.empty(8, dtype=torch.uint8), DIGEST) for k in nowhere]
    with DiskStore(root) as s:
        reasons = s.load_into(first, lambda: [LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
    assert reasons == [Reason.MISSING] * 3 + [Reason.OK] * N
    assert all(torch.equal(o, make_payload(f"p{i}", SIZES[i])) for i, o in enumerate(outs))
    assert served == [N]


def test_bounce_memory_is_bounded_by_the_chunks_in_flight(tmp_path, monkeypatch, served) -> None:
    chunk = 64 << 10
    monkeypatch.setattr(packed.PackedLoad, "chunk_bytes", chunk)
    sizes = [3000] * 300  # ~950 KB of records: fifteen chunks
    root = str(tmp_path / "store")
    keys = _populate(root, sizes, "b")
    out, peak, asked = [0], [0], {}
    real_acquire, real_release = BufferPool.acquire, BufferPool.release

    def acquire(self, nbytes):
        buf = real_acquire(self, nbytes)
        out[0] += nbytes
        peak[0] = max(peak[0], out[0])
        asked[id(buf)] = nbytes
        return buf

    def release(self, buf):
        out[0] -= asked.pop(id(buf), 0)
        return real_release(self, buf)

    monkeypatch.setattr(BufferPool, "acquire", acquire)
    monkeypatch.setattr(BufferPool, "release", release)
    with DiskStore(root) as s:
        reasons, outs = _load(s, keys, sizes)
    assert reasons == [Reason.OK] * len(sizes) and served == [len(sizes)]
    assert all(torch.equal(o, make_payload(f"b{i}", n)) for i, (o, n) in enumerate(zip(outs, sizes)))
    assert out[0] == 0
    # The chunks being read and the one being checked; a run may end a record and an alignment past its window.
    assert peak[0] <= (packed.PackedLoad.in_flight + 1) * (chunk + 3 * 4096)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Small and large records, for loads asked every way (answers compared, never damaged: loads only read)."""
    root = str(tmp_path_factory.mktemp("mixed") / "store")
    sizes = [random.Random(100 + i).choice([1, 100, 1000, 4095, 4096, 9000]) for i in range(40)]
    return root, _populate(root, sizes, "m"), sizes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(
        st.tuples(
            st.integers(0, 39),
            st.sampled_from(["ok", "missing", "digest", "length", "large-target"]),
            st.booleans(),  # the target at a 4096-aligned address (a large payload is read straight into it)
        ),
        min_size=1,
        max_size=30,
    )
)
def test_the_packed_path_answers_as_the_general_path_does(mixed, monkeypatch, picks) -> None:
    root, keys, sizes = mixed
    with DiskStore(root) as s:
        ns = keys[0].namespace

        def ask():
            reqs = []
            for i, how, aligned in picks:
                key = make_key(ns, f"absent{i}") if how == "missing" else keys[i]
                n = sizes[i] + (1 if how == "length" else 0)
                n = max(n, 5000) if how == "large-target" else n
                digest = b"X" * 16 if how == "digest" else DIGEST
                out = slot_like(n, 0x55) if aligned else slot_like(n + 64, 0x55)[64:]
                reqs.append(LoadRequest(key, out, digest))
            return reqs

        packed_reqs = ask()
        packed_reasons = s.load_into(packed_reqs)
        with monkeypatch.context() as m:
            m.setattr(aio, "acquire", lambda: None)  # the same pipeline through threads
            general_reqs = ask()
            general_reasons = s.load_into(general_reqs)
    assert packed_reasons == general_reasons
    for a, b, r in zip(packed_reqs, general_reqs, packed_reasons):
        if r is Reason.OK:
            assert torch.equal(a.out, b.out)


GROUP_BYTES = {"s1": 100, "s2": 1000, "s3": 4095, "big": 9000}  # the last is large: read into its slot


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """Records of four groups (fixed sizes, as a profile's), for loads asked as LoadBatches."""
    root = str(tmp_path_factory.mktemp("grouped") / "store")
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        items = [
            (make_key(ns, f"{g}{i}", g), make_payload(f"{g}{i}", n), DIGEST)
            for g, n in GROUP_BYTES.items()
            for i in range(8)
        ]
        s.store_many(items)
    return root, ns


def _pools(digest_of: dict[str, bytes]) -> tuple[TargetGroup, ...]:
    """A pool of 8 slots per group, 4096-aligned slots (as the daemon's), 0x55 everywhere; the last slot one byte
    short (its view as torch slices it: the length is refused)."""
    groups = []
    for g, n in GROUP_BYTES.items():
        stride = -(-n // 4096) * 4096
        pool = slot_like(7 * stride + n - 1, 0x55)
        groups.append(TargetGroup(g, CacheForm.COMPRESSED, digest_of.get(g, DIGEST), pool, stride, n))
    return tuple(groups)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.sampled_from(["ok", "missing", "short"])),
        min_size=1,
        max_size=24,
        unique_by=lambda p: (p[0], p[1]),  # one object per slot
    ),
    wrong_digest=st.sets(st.sampled_from(sorted(GROUP_BYTES)), max_size=2),
)
def test_a_load_batch_answers_as_its_requests_do(grouped, monkeypatch, picks, wrong_digest) -> None:
    """The packed path's columns (no request built per object) against the same requests as a list through the
    thread strategy: the same answers, the same bytes in the same slots."""
    root, ns = grouped
    names = list(GROUP_BYTES)
    digests = {g: b"X" * 16 for g in wrong_digest}

    def batch(groups):
        hashes = [
            make_key(ns, f"{'absent' if how == 'missing' else ''}{names[g]}{i}").block_hash for g, i, how in picks
        ]
        slots = [7 if how == "short" else i for g, i, how in picks]
        return LoadBatch(ns, groups, np.array([g for g, _, _ in picks]), hashes, np.array(slots))

    with DiskStore(root) as s:
        a = batch(_pools(digests))
        built = []
        real = LoadBatch.__getitem__

        def getitem(self, i):
            if not isinstance(i, slice):
                built.append(i)
            return real(self, i)

        with monkeypatch.context() as m:
            m.setattr(LoadBatch, "__getitem__", getitem)
            packed_reasons = s.load_into(a)
        b = batch(_pools(digests))
        with monkeypatch.context() as m:
            m.setattr(aio, "acquire", lambda: None)  # the same pipeline through threads
            general_reasons = s.load_into(list(b))
    assert packed_reasons == general_reasons
    for ga, gb in zip(a.groups, b.groups):
        assert torch.equal(ga.tensor, gb.tensor)
    # A request was built (once or twice) only for what the packed path did not serve: a slot past the end of its
    # pool, or a request it does not read (a miss, a stale digest), named from the index.
    served = [r is Reason.OK and how == "ok" for (_, _, how), r in zip(picks, packed_reasons)]
    assert len(set(built)) == len(picks) - sum(served)


def test_a_slot_wholly_outside_its_pool_is_refused_before_any_read(grouped) -> None:
    root, ns = grouped
    groups = _pools({})
    batch = LoadBatch(
        ns, groups, np.array([0, 0]), [make_key(ns, f"s1{i}").block_hash for i in range(2)], np.array([0, 9])
    )
    with DiskStore(root) as s, pytest.raises(StoreRequestError, match="non-empty"):
        s.load_into(batch)
    assert (groups[0].tensor == 0x55).all()


# Small and large records interleaved as a restore writes them (large: an aligned bulk, some with a tail).
MIXED_SIZES = [1000, 9000, 300, 8192, 16384, 2000, 4096, 5000, 700, 12345] * 4
LARGE = [i for i, n in enumerate(MIXED_SIZES) if n >= 4096]


@pytest.fixture
def mixed_large(tmp_path):
    root = str(tmp_path / "store")
    return root, _populate(root, MIXED_SIZES, "x")


def _slot_load(store: DiskStore, keys, sizes, picks=None) -> tuple[list[Reason], list[torch.Tensor]]:
    picks = range(len(keys)) if picks is None else picks
    outs = [slot_like(sizes[i]) for i in picks]
    return store.load_into([LoadRequest(keys[i], o, DIGEST) for i, o in zip(picks, outs)]), outs


@pytest.fixture
def submits(monkeypatch) -> list[tuple[list[aio.ReadOp], int]]:
    """Every batch of reads the AIO context is handed, with the bytes in flight when it was."""
    seen: list[tuple[list[aio.ReadOp], int]] = []
    real = aio.AioContext.submit

    def submit(self, ops):
        seen.append((list(ops), self.pending_bytes))
        return real(self, ops)

    monkeypatch.setattr(aio.AioContext, "submit", submit)
    return seen


def test_a_scan_reads_one_background_piece_at_a_time_where_a_load_reads_several(tmp_path, submits) -> None:
    """The verifier's checks (a scan) beside the engines' loads: about BACKGROUND_IO_BYTES in flight at most; a load
    of the same records keeps more out at once."""
    sizes = [60_000] * 150  # ~9 MB of neighbours: runs that a load reads CHUNK_BYTES at a time, two chunks out
    root = str(tmp_path / "store")
    keys = _populate(root, sizes, "v")

    def most_in_flight() -> int:
        return max(pending + sum(n for op in ops for _, n in op.iov) for ops, pending in submits)

    with DiskStore(root) as s:
        assert all(r.reason is Reason.OK for r in s.verify_many(keys, apply=False))
        scanned, biggest = most_in_flight(), max(sum(n for _, n in op.iov) for ops, _ in submits for op in ops)
        submits.clear()
        reasons, _ = _load(s, keys, sizes)
    assert reasons == [Reason.OK] * len(sizes)
    piece = BACKGROUND_IO_BYTES + HEADER_BYTES + sizes[0] + 2 * 4096  # a run ends with the record crossing its end
    assert scanned <= piece and biggest <= piece
    assert most_in_flight() > 2 * piece


def _addresses(submits) -> set[int]:
    """The address of every buffer a read went into."""
    return {a for ops, _ in submits for op in ops for a, n in op.iov if n}


def test_large_records_among_small_ones_are_read_straight_into_their_targets(mixed_large, served, submits) -> None:
    root, keys = mixed_large
    with DiskStore(root) as s:
        reasons, outs = _slot_load(s, keys, MIXED_SIZES)
    assert reasons == [Reason.OK] * len(keys)
    assert all(torch.equal(o, make_payload(f"x{i}", n)) for i, (o, n) in enumerate(zip(outs, MIXED_SIZES)))
    assert served == [len(keys)]
    targets = {o.data_ptr() for i, o in enumerate(outs) if i in LARGE}
    assert targets <= _addresses(submits)  # the bytes moved once: disk to target


@pytest.mark.parametrize("window", [None, 128 << 10, 64 << 20])
def test_large_records_alone_are_read_straight_into_their_targets(
    mixed_large, served, submits, monkeypatch, window
) -> None:
    """With a `window`: large payloads cut into 4 KiB pieces (the mixed records' payloads hold up to four), chunks
    of about a record, at most `window` bytes in flight and, past the IN_FLIGHT chunks, half of the load's (a disk
    that returns a batch of reads together gives the first wave back while it reads the rest)."""
    if window is not None:
        monkeypatch.setattr(packed, "PIECE_BYTES", 4096)
        monkeypatch.setattr(packed.PackedLoad, "chunk_bytes", 8192)
        monkeypatch.setattr(packed, "WINDOW_BYTES", window)
    root, keys = mixed_large
    with DiskStore(root) as s:
        reasons, outs = _slot_load(s, keys, MIXED_SIZES, LARGE)
    assert reasons == [Reason.OK] * len(LARGE) and served == [len(LARGE)]
    assert all(torch.equal(o, make_payload(f"x{i}", MIXED_SIZES[i])) for i, o in zip(LARGE, outs))
    assert {o.data_ptr() for o in outs} <= _addresses(submits)
    if window is None:
        return
    sizes = [sum(n for _, n in op.iov) for ops, _ in submits for op in ops]
    assert len(sizes) > 2 * len(LARGE)  # cut: a 16 KiB payload is four reads
    # (a piece may hold a quarter piece more: a record's header and tail are no read of their own)
    assert max(sizes) <= 4096 + 1024 + HEADER_BYTES
    # More than IN_FLIGHT chunks (each under 24 KiB: a record and the gap before it) are out at once, as many as fit
    # in the window and in half of the load's reads, and no more.
    most = max(pending + sum(n for op in ops for _, n in op.iov) for ops, pending in submits)
    assert 2 * (24 << 10) < most <= min(window, sum(sizes) // 2)


@pytest.mark.parametrize("alone", [False, True])
def test_a_large_target_off_the_direct_alignment_is_read_through_the_bounce_buffer(
    mixed_large, served, submits, alone
) -> None:
    root, keys = mixed_large
    odd = slot_like(MIXED_SIZES[1] + 64)[64:]  # 64 bytes past a page: no O_DIRECT target
    asks = [] if alone else [LoadRequest(keys[0], slot_like(MIXED_SIZES[0]), DIGEST)]
    with DiskStore(root) as s:
        reasons = s.load_into([*asks, LoadRequest(keys[1], odd, DIGEST)])
    assert reasons == [Reason.OK] * (len(asks) + 1) and served == [len(asks) + 1]
    assert torch.equal(odd, make_payload("x1", MIXED_SIZES[1]))
    assert odd.data_ptr() not in _addresses(submits)  # read into the bounce buffer, copied once checked


def test_a_large_record_asked_twice_into_targets_of_each_kind_is_served_twice(mixed_large, served, submits) -> None:
    """The same large record into a target off the direct alignment (its payload through the bounce buffer) and into
    one on it (its payload's bulk straight into the target): each copy has its own run, so neither looks for its
    payload where the other's read put it."""
    root, keys = mixed_large
    odd = slot_like(MIXED_SIZES[1] + 64)[64:]
    aligned = slot_like(MIXED_SIZES[1])
    with DiskStore(root) as s:
        reasons = s.load_into([LoadRequest(keys[1], odd, DIGEST), LoadRequest(keys[1], aligned, DIGEST)])
        states = [r.entry.state for r in s.records([keys[1]])]
    assert reasons == [Reason.OK, Reason.OK] and served == [2]
    assert torch.equal(odd, make_payload("x1", MIXED_SIZES[1])) and torch.equal(aligned, odd)
    assert states == [RecordState.LIVE]
    assert aligned.data_ptr() in _addresses(submits) and odd.data_ptr() not in _addresses(submits)


@pytest.mark.parametrize(
    "where, quarantined",
    [
        ("bulk", QuarantineReason.PAYLOAD),  # read into the target
        ("tail", QuarantineReason.PAYLOAD),  # read into the bounce buffer, copied after the bulk
        ("header", QuarantineReason.HEADER),
    ],
)
def test_a_damaged_large_record_fails_alone_and_is_quarantined(mixed_large, served, where, quarantined) -> None:
    root, keys = mixed_large
    victim = 9  # 12,345 bytes: a bulk and a tail
    with DiskStore(root) as s:
        e = s.records([keys[victim]])[0].entry
        at = {
            "bulk": e.payload_offset + 100,
            "tail": e.payload_offset + MIXED_SIZES[victim] - 1,
            "header": e.offset + 60,
        }
        flip_bit(segment_path(root, e.segment), at[where], 5)
        reasons, outs = _slot_load(s, keys, MIXED_SIZES)
        assert served == [len(keys) - 1]
        assert reasons[victim] is Reason.CORRUPT
        assert [r for i, r in enumerate(reasons) if i != victim] == [Reason.OK] * (len(keys) - 1)
        assert all(torch.equal(o, make_payload(f"x{i}", MIXED_SIZES[i])) for i, o in enumerate(outs) if i != victim)
        entry = s.records([keys[victim]])[0].entry
        assert entry.state is RecordState.QUARANTINED and entry.quarantine is quarantined


@pytest.mark.parametrize("pieces", [False, True])
def test_a_cut_inside_a_large_payload_fails_it_and_those_after(mixed_large, served, monkeypatch, pieces) -> None:
    root, keys = mixed_large
    if pieces:  # the cut falls inside one of the payload's pieces, the ones after it read nothing
        monkeypatch.setattr(packed, "PIECE_BYTES", 4096)
    with DiskStore(root) as s:
        entries = [s.records([k])[0].entry for k in keys]
        victim = LARGE[len(LARGE) // 2]
        cut = entries[victim].payload_offset + 4096 + 7
        os.truncate(segment_path(root, entries[0].segment), cut)
    with DiskStore(root) as s:
        reasons, outs = _slot_load(s, keys, MIXED_SIZES)
        whole = [e.offset + e.record_len <= cut for e in entries]
        assert reasons == [Reason.OK if w else Reason.CORRUPT for w in whole]
        assert served == [sum(whole)]
        assert all(torch.equal(o, make_payload(f"x{i}", MIXED_SIZES[i])) for i, o in enumerate(outs) if whole[i])
        assert s.records([keys[victim]])[0].entry.quarantine is QuarantineReason.SEGMENT_TRUNCATED


def test_a_store_that_may_load_takes_its_bounce_buffers_at_open(small, monkeypatch) -> None:
    """A store that may load (the daemon's writer, an engine's reader) faults in the packed path's bounce buffers
    when it opens: its first load takes every buffer from the pool. A read-only store (the CLI's) and a writer told
    to wait (`take_load_resources=False`, a daemon before torch loads) make theirs in their first load."""
    root, keys = small
    made: list[int] = []
    real_init = io_mod.AlignedBuffer.__init__

    def init(self, capacity):
        made.append(capacity)
        real_init(self, capacity)

    monkeypatch.setattr(io_mod.AlignedBuffer, "__init__", init)
    for opened, takes in (
        ({"writer": True}, True),
        ({}, True),
        ({"readonly": True}, False),
        ({"writer": True, "take_load_resources": False}, False),
    ):
        made.clear()
        with DiskStore(root, **opened) as s:
            at_open = made.count(packed.CHUNK_BYTES)
            made.clear()
            reasons, outs = _load(s, keys, SIZES)
            assert reasons == [Reason.OK] * N
            assert all(torch.equal(o, make_payload(f"p{i}", n)) for i, (o, n) in enumerate(zip(outs, SIZES)))
        assert (at_open, len(made)) == ((packed.IN_FLIGHT + 1, 0) if takes else (0, 1)), opened
