"""Integrity: bit flips (payload, header, LMDB value), truncation, deletion, retirement are misses, never bytes."""

from __future__ import annotations

import os
import shutil

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core import CacheForm, Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, QuarantineReason, RecordState
from kvtier.store.index import encode_key
from kvtier.store.record import HEADER_BYTES
from support.corrupt import flip_bit, flip_payload_bit, segment_path
from support.store_helpers import DIGEST, VK, make_key, make_payload, slot_like

SIZES = (10_000, 70_000, 4096, 33_333)


def _populate(root: str) -> list:
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK, codecs={CacheForm.SWA: "zstd"})
        keys = [make_key(ns, f"k{i}") for i in range(len(SIZES))]
        keys[-1] = make_key(ns, "k3", "swa", CacheForm.SWA)
        for i, k in enumerate(keys):
            payload = make_payload(f"k{i}", SIZES[i])
            if k.form is CacheForm.SWA:
                payload = payload // 64  # compressible
            s.store(k, payload, DIGEST)
    return keys


def _expected(i: int) -> torch.Tensor:
    p = make_payload(f"k{i}", SIZES[i])
    return p // 64 if i == len(SIZES) - 1 else p


@pytest.fixture
def populated(tmp_path):
    root = str(tmp_path / "store")
    keys = _populate(root)
    return root, keys


def _entry(store: DiskStore, key):
    (info,) = [r for r in store.iter_records() if r.key == key]
    return info.entry


def _load_all(store: DiskStore, keys) -> tuple[list[Reason], list[torch.Tensor]]:
    outs = [slot_like(n) for n in SIZES]  # aligned: the large payloads are read straight into them
    return store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]), outs


def _assert_only_victim_fails(store: DiskStore, keys, victim: int, reason: Reason) -> list[torch.Tensor]:
    reasons, outs = _load_all(store, keys)
    for i, (r, o) in enumerate(zip(reasons, outs)):
        if i == victim:
            assert r is reason  # what the slot holds is undefined (a direct read may have filled it): unused
        else:
            assert r is Reason.OK and torch.equal(o, _expected(i))
    return outs


@pytest.mark.parametrize(
    ("victim", "where", "why"),
    [
        (1, HEADER_BYTES + 12345, QuarantineReason.PAYLOAD),
        (1, 20, QuarantineReason.HEADER),  # inside the namespace field
        (2, 148, QuarantineReason.HEADER),  # reserved bytes of the inline header, still checksummed
        (3, HEADER_BYTES + 5, QuarantineReason.PAYLOAD),  # zstd stream
    ],
)
def test_bit_flip_in_segment_is_corrupt_and_quarantined(populated, victim, where, why, read_path) -> None:
    root, keys = populated
    with DiskStore(root) as s:
        e = _entry(s, keys[victim])
        flip_bit(segment_path(root, e.segment), e.offset + where, 3)
        assert s.has(keys, [DIGEST] * 4) == [Reason.OK] * 4  # index-only: not yet known
        _assert_only_victim_fails(s, keys, victim, Reason.CORRUPT)
        q = _entry(s, keys[victim])
        assert q.state is RecordState.QUARANTINED and q.quarantine is why and q.quarantined_at > 0
        assert s.has([keys[victim]], [DIGEST]) == [Reason.CORRUPT]


def test_bit_flip_inside_lmdb_value_is_corrupt(populated) -> None:
    root, keys = populated
    env = lmdb.open(os.path.join(root, "index.lmdb"), max_dbs=8)
    obj = env.open_db(b"obj")
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(encode_key(keys[0]), db=obj))
        value[30] ^= 0x10  # inside the record-length field: LMDB returns it without complaint
        txn.put(encode_key(keys[0]), bytes(value), db=obj)
    env.close()
    with DiskStore(root) as s:
        assert s.has(keys, [DIGEST] * 4) == [Reason.CORRUPT] + [Reason.OK] * 3
        _assert_only_victim_fails(s, keys, 0, Reason.CORRUPT)
        (info,) = [r for r in s.iter_records() if r.key == keys[0]]
        assert info.entry.state is RecordState.QUARANTINED and info.entry.quarantine is QuarantineReason.INDEX_VALUE


def test_truncated_segment_is_corrupt_for_records_past_the_cut(populated, read_path) -> None:
    root, keys = populated
    with DiskStore(root) as s:
        e = _entry(s, keys[2])
        os.truncate(segment_path(root, e.segment), e.offset + 2 * HEADER_BYTES - 100)
        reasons, outs = _load_all(s, keys)
        assert reasons[:2] == [Reason.OK, Reason.OK] and reasons[2:] == [Reason.CORRUPT] * 2
        assert all(torch.equal(o, _expected(i)) for i, o in enumerate(outs[:2]))
        assert _entry(s, keys[2]).quarantine is QuarantineReason.SEGMENT_TRUNCATED


def test_deleted_segment_is_missing_and_quarantined(populated) -> None:
    root, keys = populated
    with DiskStore(root) as s:
        os.unlink(segment_path(root, _entry(s, keys[0]).segment))
        reasons, outs = _load_all(s, keys)
        assert reasons == [Reason.MISSING] * 4 and all((o == 0xAA).all() for o in outs)
        assert {r.entry.quarantine for r in s.iter_records()} == {QuarantineReason.SEGMENT_MISSING}
        assert s.has(keys, [DIGEST] * 4) == [Reason.MISSING] * 4


def test_retired_namespace_is_stale_not_quarantined(populated) -> None:
    root, keys = populated
    with DiskStore(root) as s:
        s.retire_namespace(keys[0].namespace)
        reasons, outs = _load_all(s, keys)
        assert reasons == [Reason.STALE_VERSION] * 4 and all((o == 0xAA).all() for o in outs)
        assert all(r.entry.state is RecordState.LIVE for r in s.iter_records())


def test_verify_catches_corruption_before_a_load_and_clears_dirty(populated) -> None:
    root, keys = populated
    with DiskStore(root) as s:
        assert [k for _, k in s.iter_dirty()] == keys
        e = _entry(s, keys[1])
        flip_payload_bit(root, e, 7, 3)
        assert [s.verify(k) for k in keys] == [Reason.OK, Reason.CORRUPT, Reason.OK, Reason.OK]
        assert [k for _, k in s.iter_dirty()] == [keys[1]]
        assert _entry(s, keys[0]).verified_at > 0 and _entry(s, keys[1]).quarantine is QuarantineReason.PAYLOAD
    with DiskStore(root, writer=True) as w:  # the writer may replace a quarantined record
        w.store(keys[1], _expected(1), DIGEST)
        _assert_only_victim_fails(w, keys, -1, Reason.OK)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pristine") / "store")
    keys = _populate(root)
    with DiskStore(root) as s:
        (seg,) = {r.entry.segment for r in s.iter_records()}
    return root, keys, segment_path(root, seg)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_bit_flip_never_yields_wrong_bytes(pristine, tmp_path, data) -> None:
    root, keys, seg_path = pristine
    work = str(tmp_path / f"w{data.draw(st.integers(0, 1 << 30))}")
    shutil.copytree(root, work)
    size = os.path.getsize(seg_path)
    offset = data.draw(st.integers(0, size - 1), label="offset")
    flip_bit(os.path.join(work, "segments", os.path.basename(seg_path)), offset, data.draw(st.integers(0, 7)))
    with DiskStore(work) as s:
        reasons, outs = _load_all(s, keys)
    for i, (r, o) in enumerate(zip(reasons, outs)):
        assert (r is Reason.OK and torch.equal(o, _expected(i))) or r is Reason.CORRUPT
    shutil.rmtree(work)
