"""The cluster tier's pure parts (no Mooncake needed): object header verdicts, names, deadline lanes, config."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cluster import ClusterConfig, ClusterUnavailable, WriteThrough
from kvtier.cluster import header as H
from kvtier.cluster.lane import Breaker, Lane, Probes
from kvtier.cluster.mooncake_client import chunks
from kvtier.core.errors import ConfigError
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey

KEY = ObjectKey(b"n" * 16, b"h" * 16, "c4/x é", CacheForm.INDEXER)
DIGEST = b"d" * 16


def _object(key: ObjectKey = KEY, payload: bytes = b"payload bytes" * 50) -> bytearray:
    obj = bytearray(H.HEADER_BYTES + len(payload))
    obj[H.HEADER_BYTES :] = payload
    H.ObjectHeader.for_payload(key, DIGEST, memoryview(obj)[H.HEADER_BYTES :]).pack_into(memoryview(obj))
    return obj


def test_names_round_trip_and_reject_others() -> None:
    name = H.object_name("kvt1", KEY)
    assert H.parse_name("kvt1", name) == KEY
    assert H.parse_name("other", name) is None and H.parse_name("kvt1", "kvt1/zz/zz/tail/g") is None


def test_verdicts() -> None:
    obj = _object()
    plen = len(obj) - H.HEADER_BYTES
    assert H.verify(memoryview(obj), KEY, DIGEST, plen) is H.Verdict.OK
    assert H.verify(memoryview(obj)[:100], KEY, DIGEST, plen) is H.Verdict.TRUNCATED
    assert H.verify(memoryview(obj)[:-1], KEY, DIGEST, plen) is H.Verdict.TRUNCATED
    assert H.verify(memoryview(obj + b"x"), KEY, DIGEST, plen) is H.Verdict.OVERSIZED
    assert H.verify(memoryview(obj), KEY, b"e" * 16, plen) is H.Verdict.LAYOUT
    assert H.verify(memoryview(obj), KEY, DIGEST, plen + 1) is H.Verdict.LAYOUT
    other = ObjectKey(KEY.namespace, KEY.block_hash, KEY.group, CacheForm.COMPRESSED)
    assert H.verify(memoryview(obj), other, DIGEST, plen) is H.Verdict.FOREIGN
    assert H.verify(memoryview(bytes(len(obj))), KEY, DIGEST, plen) is H.Verdict.GARBAGE


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=7))
def test_any_single_bit_flip_is_never_ok(at: int, bit: int) -> None:
    obj = _object()
    obj[at % len(obj)] ^= 1 << bit
    assert H.verify(memoryview(obj), KEY, DIGEST, len(obj) - H.HEADER_BYTES) is not H.Verdict.OK


def test_lane_answers_within_the_deadline_and_stays_busy_until_the_call_returns() -> None:
    """A data call past its deadline is a miss for that call and a hint to the prober, not a dead cluster: the
    breaker stays up (a loaded host is slow; issue 40: one slow existence call marked the cluster down)."""
    breaker = Breaker(retry_s=0.3)
    lane = Lane("t", breaker)
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(ClusterUnavailable, match="deadline"), lane.hold(time.monotonic() + 0.1) as run:
        run(release.wait)
    assert time.monotonic() - t0 < 0.5
    assert breaker.up and breaker.wake.is_set()  # up, and the prober asked to look now
    breaker.wake.clear()
    with pytest.raises(ClusterUnavailable, match="still running"), lane.hold(time.monotonic() + 0.1):
        pass  # the stuck call keeps the lane (and its buffers) until it returns
    assert breaker.up and breaker.wake.is_set()
    release.set()
    with lane.hold(time.monotonic() + 2.0) as run:
        assert run(lambda: 7) == 7
    assert lane.close(time.monotonic() + 1.0)


def test_a_probe_past_its_deadline_marks_the_cluster_down_and_the_next_runs_beside_it() -> None:
    """The probe's timeout is the evidence (a stopped master never answers): data calls then fail at once for
    retry_s. A probe still stuck (a client reconnecting for seconds) does not hold up the next one, which brings
    the cluster back as soon as it is answered; at most `at_once` run, beyond that the cluster is down."""
    breaker = Breaker(retry_s=30.0)
    probes, data = Probes(breaker, at_once=2), Lane("t", breaker)
    release = threading.Event()
    with pytest.raises(ClusterUnavailable, match="deadline"):
        probes.run(release.wait, time.monotonic() + 0.1)
    assert not breaker.up and "probe" in breaker.why
    with pytest.raises(ClusterUnavailable, match="marked down"), data.hold(time.monotonic() + 0.1):
        pass
    assert probes.run(lambda: 7, time.monotonic() + 2.0) == 7  # beside the stuck one
    with pytest.raises(ClusterUnavailable, match="deadline"):
        probes.run(release.wait, time.monotonic() + 0.1)  # a second stuck one: two run
    with pytest.raises(ClusterUnavailable, match="2 earlier probes"):
        probes.run(lambda: 7, time.monotonic() + 2.0)
    assert not probes.close(time.monotonic() + 0.1)  # they still run
    release.set()
    assert probes.close(time.monotonic() + 2.0) and data.close(time.monotonic() + 1.0)


def test_a_call_started_and_never_waited_for_keeps_the_lane_until_it_returns() -> None:
    """A pipelined get starts the next batch before it sinks the one before; if the hold ends early (the sink's
    batch missed the deadline), the started call still writes into staging: the lane stays taken until it ends."""
    lane = Lane("t", Breaker(retry_s=0.0))
    release = threading.Event()
    with lane.hold(time.monotonic() + 1.0) as calls:
        first = calls.start(lambda: 1)
        calls.start(release.wait)  # in flight when the hold ends
        assert calls.wait(first) == 1
    with pytest.raises(ClusterUnavailable, match="still running"), lane.hold(time.monotonic() + 0.1):
        pass
    release.set()
    with lane.hold(time.monotonic() + 2.0) as run:
        assert run(lambda: 7) == 7
    assert lane.close(time.monotonic() + 1.0)


def test_a_lane_closed_under_a_running_call_says_so_and_takes_no_more() -> None:
    """MooncakeClient.close tears the client down only when its lanes are idle (else the call would crash)."""
    lane = Lane("t", Breaker(retry_s=0.0))
    release = threading.Event()
    with pytest.raises(ClusterUnavailable), lane.hold(time.monotonic() + 0.05) as run:
        run(release.wait)
    assert not lane.close(time.monotonic() + 0.1)  # the stuck call still runs
    release.set()
    assert lane.close(time.monotonic() + 2.0)  # it returned: idle
    with pytest.raises(ClusterUnavailable, match="closed"), lane.hold(time.monotonic() + 1.0) as run:
        run(lambda: 7)


def test_the_breaker_says_down_until_a_call_is_answered_and_a_probe_passes_it() -> None:
    """`up` is the last answer, not the end of the fail-fast window (the lie of issue 40: "up" again once
    retry_s had passed, with nothing asked); a probe is let through while calls fail fast."""
    breaker = Breaker(retry_s=0.0)
    assert breaker.up
    breaker.failed("master gone")
    breaker.check("lookup")  # the fail-fast window is over: a call may go and ask ...
    assert not breaker.up and breaker.why == "master gone"  # ... but only an answer brings the cluster back
    assert breaker.quiet_s < 1.0
    breaker.succeeded()
    assert breaker.up and breaker.why == ""
    shared = Breaker(retry_s=60.0)
    lane, probes = Lane("t", shared), Probes(shared)
    shared.failed("gone")
    with pytest.raises(ClusterUnavailable, match="marked down"), lane.hold(time.monotonic() + 1.0):
        pass
    assert probes.run(lambda: 3, time.monotonic() + 1.0) == 3  # let through while down
    assert lane.close(time.monotonic() + 1.0) and probes.close(time.monotonic() + 1.0)


def test_chunks_fit_the_staging_buffer() -> None:
    assert chunks([10, 10, 100, 10], 64) == [[0], [1], [2], [3]]  # 64-byte slots
    assert chunks([64, 64, 64], 128) == [[0, 1], [2]]


def test_config_validation_and_policy() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.replicas"):
        ClusterConfig(replicas=0)
    with pytest.raises(ConfigError, match=r"cluster\.backend"):
        ClusterConfig(backend="redis")
    assert ClusterConfig(etcd="127.0.0.1:2379").master_address == "etcd://127.0.0.1:2379"
    # the default sends state objects too: without them another node has no usable hit (issue 40)
    assert ClusterConfig().write_through is WriteThrough.ALL and WriteThrough.ALL.covers(CacheForm.SWA)
    assert WriteThrough.ALL.covers(CacheForm.TAIL) and WriteThrough.ALL.covers(CacheForm.COMPRESSED)
    assert not WriteThrough.OFF.covers(CacheForm.COMPRESSED) and not WriteThrough.OFF.covers(CacheForm.TAIL)
    with pytest.raises(ConfigError, match=r"cluster\.probe_s"):
        ClusterConfig(probe_s=0)


def test_a_history_only_write_through_is_refused_with_the_choices(tmp_path) -> None:
    """A history-only write-through gave other nodes no usable hit: asking for it is an error naming the choices."""
    from kvtier.core.config import load_config

    path = tmp_path / "kvtier.toml"
    path.write_text('[cluster]\nenabled = true\nwrite_through = "history"\n')
    with pytest.raises(ConfigError, match=r"cluster\.write_through.*must be one of off, all"):
        load_config(str(path))
    path.write_text("[cluster]\nenabled = true\nprobe_s = 0.25\n")
    cfg = load_config(str(path)).cluster
    assert cfg.probe_s == 0.25 and cfg.write_through is WriteThrough.ALL


def test_verify_stored_needs_no_layout_but_catches_every_fault() -> None:
    """The audit's check: an object is judged by its own header (layout and size unknown to the auditor)."""
    obj = _object()
    assert H.verify_stored(memoryview(obj), KEY) is H.Verdict.OK
    other = ObjectKey(b"n" * 16, b"H" * 16, "c4/x é", CacheForm.INDEXER)
    flipped = bytearray(obj)
    flipped[-1] ^= 1
    cases = {
        H.Verdict.FOREIGN: (obj, other),
        H.Verdict.TRUNCATED: (obj[: len(obj) - 1], KEY),
        H.Verdict.OVERSIZED: (obj + b"\0", KEY),
        H.Verdict.CHECKSUM: (flipped, KEY),
        H.Verdict.GARBAGE: (bytearray(len(obj)), KEY),
    }
    for verdict, (data, key) in cases.items():
        assert H.verify_stored(memoryview(bytes(data)), key) is verdict, verdict
    assert H.verify_stored(memoryview(b"short"), KEY) is H.Verdict.TRUNCATED


def test_cluster_audit_report_renders_and_flags_corruption() -> None:
    from kvtier.cli.cluster_census import render_cluster
    from kvtier.cluster.census import ClusterAuditReport, FormTally

    counts = {b"n" * 16: {CacheForm.COMPRESSED: FormTally(objects=5), CacheForm.TAIL: FormTally(objects=1, absent=2)}}
    clean = ClusterAuditReport("local index", counts, other_keys=3, sampled=4, verdicts={"ok": 3, "missing": 1})
    assert not clean.problems
    text = render_cluster(clean)
    assert "keys from local index; 3 other keys" in text and "verified: missing 1, ok 3" in text
    assert [line.split()[1:] for line in text.splitlines()[2:4]] == [["compressed", "5", "0"], ["tail", "1", "2"]]
    doc = clean.to_json()
    assert doc["namespaces"][(b"n" * 16).hex()]["tail"] == {"objects": 1, "absent": 2}
    assert ClusterAuditReport("x", {}, 0, 1, {"checksum": 1}).problems


def test_the_background_copy_is_its_own_bytes_in_the_callers_dtype() -> None:
    """bytes_copy.cpu_copy (the background writer's copy of a pool slot, by numpy in the calling thread): equal
    bytes, flat, same dtype, its own memory (the slot may be reused once the caller returns)."""
    from kvtier.cluster.bytes_copy import cpu_copy

    for src in (torch.arange(300, dtype=torch.uint8), torch.randn(4, 6).to(torch.bfloat16), torch.randn(6, 4)[:, 1]):
        copy = cpu_copy(src)
        assert copy.dtype == src.dtype and copy.dim() == 1 and torch.equal(copy, src.reshape(-1))
        before = copy.clone()
        src.zero_()
        assert torch.equal(copy, before) and copy.data_ptr() != src.data_ptr()
