"""Property: for any mix of faults on disk, every read path answers every request of a load as a model of the
record format says, names the same quarantine reason and serves the same bytes.

The store holds records of several sizes (small ones the packed path serves, large ones read straight into an
aligned target or through the bounce buffer) in three segments. Hypothesis draws per record no fault, a bit flipped
in its header, a bit flipped in its payload, or an index entry whose creation time no longer matches its header;
per segment nothing, a truncation inside one of its records (a short read of every record from there on), or the
file gone; and a load: any subset of the records in any order, duplicates, keys never stored, aligned and unaligned
targets. The same faults are put on a fresh copy of the store for each read path (native AIO with the packed path,
and threads), and each load is checked against the model and against the other path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, IndexEntry, QuarantineReason, aio, encode_key
from support.corrupt import flip_bit, segment_path
from support.store_helpers import DIGEST, VK, make_key, make_payload, slot_like

SIZES = (1000, 300, 6000, 1000, 20_000, 8192, 2000, 100_000)  # one segment's records, in write order
SEGMENTS = 3
RECORDS = len(SIZES) * SEGMENTS
NONE, HEADER_FLIP, PAYLOAD_FLIP, CREATED = range(4)


@dataclasses.dataclass(frozen=True)
class Template:
    root: str
    keys: list
    entries: list[IndexEntry]  # per record, as written
    segment_of: list[int]  # per record: which of the SEGMENTS (0..2)
    seg_ids: list[int]


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Template:
    root = str(tmp_path_factory.mktemp("faults") / "store")
    keys = []
    for s in range(SEGMENTS):  # a new writer starts a new segment: three sessions, three segments
        with DiskStore(root, writer=True) as st_:
            ns = st_.register_namespace(VK)
            batch = [make_key(ns, f"r{s}-{i}") for i in range(len(SIZES))]
            st_.store_many([(k, make_payload(k.block_hash.hex(), n), DIGEST) for k, n in zip(batch, SIZES)])
            keys += batch
    with DiskStore(root) as st_:
        by_key = {r.key: r.entry for r in st_.iter_records(limit=RECORDS + 1)}
    entries = [by_key[k] for k in keys]
    seg_ids = sorted({e.segment for e in entries})
    assert len(seg_ids) == SEGMENTS
    return Template(root, keys, entries, [seg_ids.index(e.segment) for e in entries], seg_ids)


record_faults = st.lists(
    st.tuples(st.sampled_from((NONE, NONE, HEADER_FLIP, PAYLOAD_FLIP, CREATED)), st.integers(0, 1 << 30)),
    min_size=RECORDS,
    max_size=RECORDS,
)
segment_faults = st.lists(
    st.tuples(
        st.sampled_from(("none", "none", "truncate", "missing")), st.integers(0, len(SIZES) - 1), st.floats(0, 1)
    ),
    min_size=SEGMENTS,
    max_size=SEGMENTS,
)
loads = st.lists(st.tuples(st.integers(-1, RECORDS - 1), st.booleans()), min_size=1, max_size=2 * RECORDS)


def _expected(t: Template, faults, segs) -> list[tuple[Reason, QuarantineReason | None]]:
    """The model: per record, what a load answers and the reason it is quarantined with (None: served)."""
    cut: dict[int, int] = {}
    for s, (kind, k, frac) in enumerate(segs):
        if kind == "truncate":
            e = [e for e, si in zip(t.entries, t.segment_of) if si == s][k]
            cut[s] = e.offset + int(frac * (e.record_len - 1))
    out = []
    for e, s, (kind, _) in zip(t.entries, t.segment_of, faults):
        if segs[s][0] == "missing":
            out.append((Reason.MISSING, QuarantineReason.SEGMENT_MISSING))
        elif s in cut and e.offset + e.record_len > cut[s]:
            out.append((Reason.CORRUPT, QuarantineReason.SEGMENT_TRUNCATED))
        elif kind == HEADER_FLIP:
            out.append((Reason.CORRUPT, QuarantineReason.HEADER))
        elif kind == CREATED:
            out.append((Reason.CORRUPT, QuarantineReason.HEADER_MISMATCH))
        elif kind == PAYLOAD_FLIP:
            out.append((Reason.CORRUPT, QuarantineReason.PAYLOAD))
        else:
            out.append((Reason.OK, None))
    return out


def _damage(root: str, t: Template, faults, segs) -> None:
    for e, (kind, pick) in zip(t.entries, faults):
        path = segment_path(root, e.segment)
        if kind == HEADER_FLIP:
            flip_bit(path, e.offset + pick % 160, pick % 8)
        elif kind == PAYLOAD_FLIP:
            flip_bit(path, e.payload_offset + pick % e.payload_len, pick % 8)
    created = [k for k, (kind, _) in zip(t.keys, faults) if kind == CREATED]
    if created:
        with DiskStore(root, writer=True) as s:

            def bump(txn) -> None:
                for key in created:
                    raw = encode_key(key)
                    entry = IndexEntry.unpack(txn.get(raw, db=s.index.obj))
                    txn.put(raw, dataclasses.replace(entry, created=entry.created + 1.0).pack(), db=s.index.obj)

            s.index.update(bump)
    for s, (kind, k, frac) in enumerate(segs):
        path = segment_path(root, t.seg_ids[s])
        if kind == "missing":
            os.unlink(path)
        elif kind == "truncate":
            e = [e for e, si in zip(t.entries, t.segment_of) if si == s][k]
            os.truncate(path, e.offset + int(frac * (e.record_len - 1)))


def _load(root: str, t: Template, load, threads: bool):
    """(reasons, each OK request's bytes, each record's quarantine reason after the load)."""
    absent = make_key(t.keys[0].namespace, "never stored")
    keys = [absent if i < 0 else t.keys[i] for i, _ in load]
    sizes = [1000 if i < 0 else SIZES[i % len(SIZES)] for i, _ in load]
    # an unaligned target: one byte into an aligned one (large payloads then go through the bounce buffer)
    outs = [slot_like(n) if aligned else slot_like(n + 1)[1:] for n, (_, aligned) in zip(sizes, load)]
    path = mock.patch.object(aio, "acquire", lambda: None) if threads else contextlib.nullcontext()
    with path, DiskStore(root, writer=True) as s:
        reasons = s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
        states = {r.key: r.entry.quarantine for r in s.iter_records(limit=RECORDS + 1)}
    served = [o.clone() if r is Reason.OK else None for r, o in zip(reasons, outs)]
    return reasons, served, [states.get(k) for k in t.keys]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(faults=record_faults, segs=segment_faults, load=loads)
def test_every_read_path_answers_every_fault_as_the_model_does(template, tmp_path_factory, faults, segs, load) -> None:
    if aio.acquire() is None:
        pytest.skip("native AIO is not available: only the thread path runs here")
    t = template
    model = _expected(t, faults, segs)
    answers = []
    for threads in (False, True):
        root = str(tmp_path_factory.mktemp("copy") / "store")
        shutil.copytree(t.root, root)
        _damage(root, t, faults, segs)
        reasons, served, states = _load(root, t, load, threads)
        for (i, _), reason, got in zip(load, reasons, served):
            if i < 0:
                assert reason is Reason.MISSING
                continue
            assert reason is model[i][0], (threads, i, model[i])
            if reason is Reason.OK:
                want = make_payload(t.keys[i].block_hash.hex(), SIZES[i % len(SIZES)])
                assert torch.equal(got, want), (threads, i)
        asked = {i for i, _ in load if i >= 0}
        for i, state in enumerate(states):
            if i in asked and model[i][1] is not None:
                # a missing segment's records stay indexed, quarantined as gone; the rest by what was wrong
                assert state is model[i][1], (threads, i, model[i], state)
            elif i not in asked:
                assert state is None  # a record no load asked for is never judged
        answers.append((reasons, states))
        shutil.rmtree(root)
    assert answers[0] == answers[1]  # the two paths agree request by request, reason by reason
