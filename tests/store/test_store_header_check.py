"""The load path's header check: one bytes comparison with the header a record's key and index entry imply,
and the full parse only where the bytes differ, which then names what is wrong: it never accepts a record the
comparison refused."""

from __future__ import annotations

import pytest
import torch

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, QuarantineReason
from kvtier.store import record_check as reader_mod
from kvtier.store.record import HEADER_BYTES
from support.corrupt import flip_bit, segment_path
from support.read_paths import replace_entry
from support.store_helpers import DIGEST, VK, make_key, make_payload

N, SIZE = 16, 1000


@pytest.fixture
def store_keys(tmp_path):
    root = str(tmp_path / "store")
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"h{i}") for i in range(N)]
        s.store_many([(k, make_payload(f"h{i}", SIZE), DIGEST) for i, k in enumerate(keys)])
    return root, keys


@pytest.fixture
def parses(monkeypatch) -> list[int]:
    """Counts the full header parses the load path falls back to (to name a failure)."""
    calls: list[int] = []
    real = reader_mod.fault

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(reader_mod, "fault", counting)
    return calls


def _load(s: DiskStore, keys) -> tuple[list[Reason], list[torch.Tensor]]:
    outs = [torch.full((SIZE,), 0xAA, dtype=torch.uint8) for _ in keys]
    return s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]), outs


def test_intact_records_pass_the_byte_check_without_a_parse(store_keys, parses) -> None:
    root, keys = store_keys
    with DiskStore(root) as s:
        reasons, outs = _load(s, keys)
    assert reasons == [Reason.OK] * N
    assert all(torch.equal(o, make_payload(f"h{i}", SIZE)) for i, o in enumerate(outs))
    assert parses == []


def test_an_entry_whose_creation_time_differs_is_refused_and_named(store_keys, parses) -> None:
    """Every writer (store, compaction, rebuild) gives an entry its header's creation time, so a header that
    differs from its entry only there is not this key's record: refused, and named `header_mismatch`."""
    root, keys = store_keys
    with DiskStore(root, writer=True) as s:
        replace_entry(s, keys[3], created=s.records(keys[3:4])[0].entry.created + 1.0)
        reasons, outs = _load(s, keys)
        (info,) = [r for r in s.iter_records() if r.key == keys[3]]
    assert reasons == [Reason.OK] * 3 + [Reason.CORRUPT] + [Reason.OK] * (N - 4)
    assert all(torch.equal(outs[i], make_payload(f"h{i}", SIZE)) for i in range(N) if i != 3)
    assert info.entry.quarantine is QuarantineReason.HEADER_MISMATCH
    assert len(parses) == 1


def test_a_flipped_header_checksum_bit_is_caught(store_keys) -> None:
    """A header whose fields are intact but whose own checksum is not fails the check (the bytes compared
    include the checksum), and only that record fails."""
    root, keys = store_keys
    with DiskStore(root) as s:
        (info,) = [r for r in s.iter_records() if r.key == keys[5]]
    entry = info.entry
    flip_bit(segment_path(root, entry.segment), entry.offset + HEADER_BYTES - 3, 1)  # inside the header checksum
    with DiskStore(root, writer=True) as s:
        reasons, _ = _load(s, keys)
        (info,) = [r for r in s.iter_records() if r.key == keys[5]]
    assert reasons == [Reason.OK] * 5 + [Reason.CORRUPT] + [Reason.OK] * (N - 6)
    assert info.entry.quarantine is QuarantineReason.HEADER
