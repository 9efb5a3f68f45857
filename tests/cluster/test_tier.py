"""ClusterTier against a real loopback Mooncake: round trip, every kind of bad object, lost holders, a lost master."""

from __future__ import annotations

import itertools
import os
import signal
import time

import pytest
import torch

from kvtier.cluster import header as H
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import LoadRequest
from support.mooncake_loopback import MooncakeCluster
from support.store_helpers import DIGEST, make_key, make_payload

NS = b"N" * 16


def _objects(tag: str, n: int, nbytes: int = 20_000) -> list:
    return [(make_key(NS, f"{tag}-{i}"), make_payload(f"{tag}-{i}", nbytes + i), DIGEST) for i in range(n)]


def _load(tier, items, digest: bytes = DIGEST) -> tuple[list[Reason], list[torch.Tensor]]:
    outs = [torch.zeros_like(p) for _, p, _ in items]
    return tier.load_into([LoadRequest(k, o, digest) for (k, _, _), o in zip(items, outs)]), outs


def _wait(cond, timeout: float, what: str):  # polls a real condition
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return got


def test_round_trip_bitwise(shared_cluster: MooncakeCluster, make_tier) -> None:
    tier = make_tier(shared_cluster)
    items = _objects("rt", 6)
    items.append((make_key(NS, "rt-swa", "swa", CacheForm.SWA), make_payload("rt-swa", 3000), DIGEST))
    tier.store_many(items)
    absent = make_key(NS, "never-stored")
    assert tier.has([k for k, _, _ in items] + [absent], [DIGEST] * (len(items) + 1)) == [Reason.OK] * len(items) + [
        Reason.MISSING
    ]
    reasons, outs = _load(tier, items)
    assert reasons == [Reason.OK] * len(items)
    assert all(torch.equal(o, p) for o, (_, p, _) in zip(outs, items))
    # the same key asked for in another layout, or with another size, is never served
    assert _load(tier, items[:1], digest=b"M" * 16)[0] == [Reason.ABI_MISMATCH]
    for nbytes in (items[0][1].numel() - 1, items[0][1].numel() // 2):  # just smaller, and far smaller
        wrong_size = torch.zeros(nbytes, dtype=torch.uint8)
        assert tier.load_into([LoadRequest(items[0][0], wrong_size, DIGEST)]) == [Reason.ABI_MISMATCH]
    assert _load(tier, items[:1])[0] == [Reason.OK]  # and the object is still there for readers of its size
    stats = tier.stats()
    assert stats.hits == len(items) + 1 and stats.misses == {"missing": 1, "layout": 2, "too_big": 1}
    assert stats.bytes_loaded == sum(H.HEADER_BYTES + p.numel() for _, p, _ in [*items, items[0]])


class _Recording:
    """The Mooncake client with its batch gets recorded (their staging ranges), everything else passed through."""

    def __init__(self, client: object) -> None:
        self._client = client
        self.batches: list[tuple[int, int]] = []  # (first byte, end) of each batch get's destinations

    def batch_get_into(self, names, ptrs, sizes):
        self.batches.append((min(ptrs), max(p + n for p, n in zip(ptrs, sizes))))
        return self._client.batch_get_into(names, ptrs, sizes)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def test_a_load_of_many_batches_is_pipelined_over_the_halves_of_staging(shared_cluster, make_tier) -> None:
    """Batches alternate between the two halves of staging (the next one transfers while the sink verifies and
    copies the one before), an object larger than half of staging is fetched alone into the whole of it, and
    every object arrives bitwise."""
    tier = make_tier(shared_cluster)  # staging_bytes 4 MiB: halves of 2 MiB
    staging = tier.cfg.staging_bytes
    items = _objects("pipe", 24, 300_000)  # six to a half (with the read slack)
    big = (make_key(NS, "pipe-big"), make_payload("pipe-big", 3 << 20), DIGEST)  # over half, under the whole
    items = [*items[:12], big, *items[12:]]
    tier.store_many(items)
    client = tier.client
    recording = client._client = _Recording(client._client)
    reasons, outs = _load(tier, items)
    assert reasons == [Reason.OK] * len(items)
    assert all(torch.equal(o, p) for o, (_, p, _) in zip(outs, items))
    base = client._get_buf.ptr
    spans = [(lo - base, hi - base) for lo, hi in recording.batches]
    assert len(spans) >= 5 and all(0 <= lo < hi <= staging for lo, hi in spans), spans
    halves = [None if hi - lo > staging // 2 else lo // (staging // 2) for lo, hi in spans]
    assert halves.count(None) == 1, spans  # the big object, alone
    for before, after in itertools.pairwise(halves):
        assert before is None or after is None or before != after, spans  # consecutive batches: the other half
    for lo, hi in spans:
        if hi - lo <= staging // 2:
            assert hi <= (lo // (staging // 2) + 1) * (staging // 2), spans  # a batch stays inside its half


def _put_raw(tier, key, data: bytes) -> None:
    def fill(_i: int, buf: memoryview) -> None:
        buf[:] = data

    assert tier.client.put([tier.name(key)], fill, [len(data)]) == [0]


def _encoded(tier, key, payload: torch.Tensor) -> bytearray:
    body = memoryview(payload.numpy())
    obj = bytearray(H.HEADER_BYTES + len(body))
    H.ObjectHeader.for_payload(key, DIGEST, body).pack_into(memoryview(obj))
    obj[H.HEADER_BYTES :] = body
    return obj


@pytest.mark.parametrize("fault", ["garbage", "truncated", "checksum", "foreign", "oversized"])
def test_bad_object_under_a_kvtier_key_is_corrupt_then_replaced(shared_cluster, make_tier, fault: str) -> None:
    tier = make_tier(shared_cluster)
    key, payload = make_key(NS, f"bad-{fault}"), make_payload(f"bad-{fault}", 10_000)
    good = _encoded(tier, key, payload)
    raw = {
        "garbage": bytes(os.urandom(len(good))),
        "truncated": bytes(good[: len(good) // 2]),
        "checksum": bytes(good[:-1]) + bytes([good[-1] ^ 0x01]),
        "foreign": bytes(_encoded(tier, make_key(NS, "someone-else"), payload)),
        "oversized": bytes(good) + b"\0" * 64,
    }[fault]
    _put_raw(tier, key, raw)
    assert tier.has([key], [DIGEST]) == [Reason.OK], tier.stats().misses  # present: only a load can tell
    reasons, out = _load(tier, [(key, payload, DIGEST)])
    assert reasons == [Reason.CORRUPT]
    assert tier.stats().misses[fault] == 1
    # the bad object is removed in the background, so the key can be written again and then served
    _wait(lambda: tier.has([key], [DIGEST]) == [Reason.MISSING], 10, "bad object removed")
    tier.store(key, payload, DIGEST)
    reasons, out = _load(tier, [(key, payload, DIGEST)])
    assert reasons == [Reason.OK] and torch.equal(out[0], payload)


@pytest.mark.parametrize("replicas", [2, 1])
def test_holder_sigkill(own_cluster: MooncakeCluster, make_tier, replicas: int) -> None:
    """Until the master declares the holder dead (client_ttl) loads touching it miss; then replicas decide."""
    tier = make_tier(own_cluster, replicas=replicas)
    items = _objects(f"holder-{replicas}", 24)
    tier.store_many(items)
    own_cluster.holders[0].kill(signal.SIGKILL)
    rounds: list[list[Reason]] = []

    def settled() -> bool:
        t0 = time.monotonic()
        reasons, outs = _load(tier, items)
        assert time.monotonic() - t0 < tier.cfg.load_timeout_s + 1.0
        assert all(torch.equal(outs[i], items[i][1]) for i, r in enumerate(reasons) if r is Reason.OK)  # never wrong
        assert set(reasons) <= {Reason.OK, Reason.MISSING}
        rounds.append(reasons)
        return tier.stats().misses.get("missing", 0) > 0 or reasons == [Reason.OK] * len(items)

    _wait(settled, own_cluster.client_ttl_s + 10, "the master noticed the dead holder")
    served = rounds[-1].count(Reason.OK)
    if replicas == 2:
        assert served == len(items)
    else:  # the dead holder's objects are gone for good, the other holder's are still served
        assert 0 < served < len(items), rounds[-1]


def test_master_killed_misses_within_deadline_then_reconnects(own_cluster: MooncakeCluster, make_tier) -> None:
    tier = make_tier(own_cluster)
    items = _objects("master", 4)
    tier.store_many(items)
    keys = [k for k, _, _ in items]
    own_cluster.masters[0].kill(signal.SIGKILL)
    for _ in range(3):  # first failure, then fast failures while marked down, then a probe that fails again
        t0 = time.monotonic()
        assert tier.has(keys, [DIGEST] * 4) == [Reason.MISSING] * 4
        assert time.monotonic() - t0 < tier.cfg.lookup_timeout_s + 0.3
        t0 = time.monotonic()
        assert _load(tier, items)[0] == [Reason.MISSING] * 4
        assert time.monotonic() - t0 < tier.cfg.load_timeout_s + 0.3
        time.sleep(tier.cfg.retry_s)  # let the breaker's wait pass, so the next round probes
    assert tier.stats().misses["unavailable"] > 0
    # a new master (no HA: the old objects are gone); the client reconnects by itself and stores again
    own_cluster.start_master()
    own_cluster.start_holder()

    def stored_again() -> bool:
        try:
            tier.store_many(items[:1])
        except Exception:  # retried until the reconnected cluster takes it
            return False
        return _load(tier, items[:1])[0] == [Reason.OK]

    _wait(stored_again, 30, "stores and loads after the master came back")


def test_master_sigstop_partition_is_bounded(own_cluster: MooncakeCluster, make_tier) -> None:
    tier = make_tier(own_cluster)
    items = _objects("stop", 3)
    tier.store_many(items)
    keys = [k for k, _, _ in items]
    with own_cluster.masters[0].stopped():
        t0 = time.monotonic()
        assert tier.has(keys, [DIGEST] * 3) == [Reason.MISSING] * 3
        assert _load(tier, items)[0] == [Reason.MISSING] * 3
        assert time.monotonic() - t0 < tier.cfg.lookup_timeout_s + tier.cfg.load_timeout_s + 0.5
    _wait(lambda: _load(tier, items)[0] == [Reason.OK] * 3, 30, "hits again after the partition healed")
