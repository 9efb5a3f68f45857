"""Large payloads read straight into their targets (bytes moved once), every record still checked."""

from __future__ import annotations

import pytest
import torch

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, QuarantineReason
from support.corrupt import flip_bit, segment_path
from support.store_helpers import DIGEST, VK, make_key, make_payload, slot_like

# Multiples of 4096, of 512 only, of neither (a tail from the bounce buffer), and one small record among them.
SIZES = (65536, 3 * 4096 + 512, 70_001, 1000, 4096)


@pytest.fixture
def store_root(tmp_path):
    root = str(tmp_path / "store")
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"d{i}") for i in range(len(SIZES))]
        s.store_many([(k, make_payload(f"d{i}", n), DIGEST) for i, (k, n) in enumerate(zip(keys, SIZES))])
    return root, keys


def _addresses(iov: list[tuple[int, int]]) -> list[int]:
    return [address for address, _ in iov]


def _load(s: DiskStore, keys, outs) -> list[Reason]:
    return s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])


def test_large_payloads_land_in_aligned_targets_in_the_same_read(store_root, read_path, scattered_reads) -> None:
    root, keys = store_root
    outs = [slot_like(n) for n in SIZES]
    with DiskStore(root) as s:
        assert _load(s, keys, outs) == [Reason.OK] * len(SIZES)
    assert all(torch.equal(o, make_payload(f"d{i}", n)) for i, (o, n) in enumerate(zip(outs, SIZES)))
    # The packed path (kvtier.store.packed) reads the load through either submit strategy, a run ending with each
    # large record: a read per large record.
    large = [n >= 4096 for n in SIZES]
    assert len(scattered_reads) == sum(large)
    direct = {o.data_ptr() for o, big in zip(outs, large) if big}
    assert direct <= {p for iov in scattered_reads for p in _addresses(iov)}  # each went straight into its target
    assert outs[3].data_ptr() not in {p for iov in scattered_reads for p in _addresses(iov)}  # small: bounced


def test_unaligned_targets_read_through_the_bounce_buffer(store_root, scattered_reads) -> None:
    root, keys = store_root
    outs = [slot_like(n + 1)[1:] for n in SIZES]  # one byte off any alignment
    with DiskStore(root) as s:
        assert _load(s, keys, outs) == [Reason.OK] * len(SIZES)
    assert all(torch.equal(o, make_payload(f"d{i}", n)) for i, (o, n) in enumerate(zip(outs, SIZES)))
    assert not {o.data_ptr() for o in outs} & {p for iov in scattered_reads for p in _addresses(iov)}


def test_the_same_record_twice_in_one_load_fills_both_targets(store_root) -> None:
    root, keys = store_root
    outs = [slot_like(SIZES[0]), slot_like(SIZES[0]), slot_like(SIZES[2])]
    with DiskStore(root) as s:
        assert _load(s, [keys[0], keys[0], keys[2]], outs) == [Reason.OK] * 3
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], make_payload("d0", SIZES[0]))
    assert torch.equal(outs[2], make_payload("d2", SIZES[2]))


@pytest.mark.parametrize("where", ["bulk", "tail", "header"])
def test_a_bit_flip_in_a_direct_record_fails_it_alone(store_root, where) -> None:
    root, keys = store_root
    victim = 2  # 70,001 bytes: an aligned bulk read direct and a 369-byte tail through the bounce buffer
    with DiskStore(root) as s:
        e = s.records([keys[victim]])[0].entry
        at = {"bulk": e.payload_offset + 4097, "tail": e.payload_offset + SIZES[victim] - 3, "header": e.offset + 40}
        flip_bit(segment_path(root, e.segment), at[where], 1)
        outs = [slot_like(n) for n in SIZES]
        reasons = _load(s, keys, outs)
        assert reasons[victim] is Reason.CORRUPT  # the target's bytes are undefined: it must not be used
        for i, (r, o) in enumerate(zip(reasons, outs)):
            if i != victim:
                assert r is Reason.OK and torch.equal(o, make_payload(f"d{i}", SIZES[i]))
        why = QuarantineReason.HEADER if where == "header" else QuarantineReason.PAYLOAD
        assert s.records([keys[victim]])[0].entry.quarantine is why
