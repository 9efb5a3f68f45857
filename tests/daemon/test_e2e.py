"""Engines as real processes against a real daemon: offload, lookup, load, read through mapped pools, crashes."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.client import Client
from kvtier.core.forms import Route
from kvtier.core.profile import load_profile
from support.daemon import DaemonProc, child_env, wait_leases_released
from support.warm_start import WarmProc
from support.workload import caches_for, compare, tokens_for

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens


def _engine(d: DaemonProc, *args: str) -> WarmProc:
    return WarmProc([str(d.socket), *args], env=child_env(), cwd=Path.cwd(), out=None, entry="support.workload:main")


def _result(proc: WarmProc) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


# The tests on `shared_daemon` use prompts of their own seeds (1-3, 9) and read counters as differences, so that one
# daemon serves them all: a daemon start is most of what each of them would cost alone.


def test_two_writers_and_a_reader(shared_daemon: DaemonProc) -> None:
    daemon = shared_daemon
    with Client(daemon.socket) as c:
        before = c.stats().forms["compressed"]
    a, b = _engine(daemon, "write", "1", "6"), _engine(daemon, "write", "2", "5")
    ra, rb = _result(a), _result(b)
    n_objects = lambda blocks: sum(len(v) for v in caches_for(PROFILE, 0, blocks).values())  # noqa: E731
    assert ra == {"written": n_objects(6), "hit_tokens": 6 * H, "checked": ra["checked"], "recovered": 0, "loaded": 0}
    assert rb["written"] == n_objects(5) and rb["hit_tokens"] == 5 * H
    assert ra["checked"] > 0 and rb["checked"] > 0
    third = _result(_engine(daemon, "read", "1", "6", "2", "5"))
    assert third["1"]["hit_tokens"] == 6 * H and third["2"]["hit_tokens"] == 5 * H
    assert third["1"]["checked"] == ra["checked"] and third["2"]["checked"] == rb["checked"]
    with Client(daemon.socket) as c:
        after = c.stats().forms["compressed"]
    assert after.reuse > before.reuse
    assert after.recompute_reasons.get("missing", 0) == before.recompute_reasons.get("missing", 0)


def test_a_prefix_of_a_written_prefix_hits_and_a_divergence_stops_the_hit(shared_daemon: DaemonProc) -> None:
    daemon = shared_daemon
    _result(_engine(daemon, "write", "3", "4"))
    with Client(daemon.socket) as c:
        c.attach("ref-tiny")
        tokens = tokens_for(3, 4, H)
        other = tokens.copy()
        other[2 * H + 5] += 1  # block 2 differs
        r = c.lookup(other)
        # history groups would serve 2 blocks, but the state checkpoints are at block 3 only: no usable hit
        assert r.hit_tokens == 0 and r.check_vector.num_blocks == 4
        c.release(r)
        r = c.lookup(tokens[: 3 * H + 7])  # a partial trailing block is not hashed
        assert r.check_vector.num_blocks == 3
        c.release(r)


def test_durable_offload_survives_a_restart_and_recovers_from_disk(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path)
    try:
        with Client(d.socket) as c:
            c.attach("ref-tiny")
            caches = caches_for(PROFILE, 7, 4)
            rep = c.offload(tokens_for(7, 4, H), caches, durable=True)
            assert rep.persisted and rep.written == sum(len(v) for v in caches.values())
            caches8 = caches_for(PROFILE, 8, 3)
            assert not c.offload(tokens_for(8, 3, H), caches8).persisted  # acknowledged at the pool write only
        assert d.terminate() == 0  # SIGTERM flushes what was acknowledged
    finally:
        d.close()
    d = DaemonProc(tmp_path)
    try:
        with Client(d.socket) as c:
            c.attach("ref-tiny")
            for seed, blocks in ((7, 4), (8, 3)):
                r = c.lookup(tokens_for(seed, blocks, H))
                assert r.hit_tokens == blocks * H
                assert (r.check_vector.routes[:, :blocks] != Route.REUSE).all()  # nothing resident after a restart
                assert r.needs_load
                rep = c.load(r)
                assert rep.loaded_objects > 0 and rep.loaded_bytes > 0
                assert compare(c, r, caches_for(PROFILE, seed, blocks)) == rep.loaded_objects
                c.release(r)
    finally:
        assert d.terminate() == 0


# The two eviction tests share one small-pool daemon (`shared_small_daemon`): prompts of their own seeds (4 and
# 100-139; 5 and 200-239), every lease released by the end of each, and eviction counted as a difference.


def test_killed_client_leases_are_released_and_slots_evictable(shared_small_daemon: DaemonProc) -> None:
    daemon = shared_small_daemon
    _result(_engine(daemon, "write", "4", "3"))
    holder = _engine(daemon, "hold", "4", "3")
    held = json.loads(holder.stdout.readline())
    assert held["hit_tokens"] == 3 * H and held["held"] > 0
    with Client(daemon.socket) as c:
        assert c.stats().profiles[0].live_leases == 1
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
    wait_leases_released(daemon.socket)
    with Client(daemon.socket) as c:
        # evictable: fill the pools with other prefixes until prefix 4's objects are pushed out to disk
        c.attach("ref-tiny")
        for seed in range(100, 140):
            c.offload(tokens_for(seed, 4, H), caches_for(PROFILE, seed, 4))
        r = c.lookup(tokens_for(4, 3, H))
        assert (r.check_vector.routes == Route.RECOVER).any(), "the formerly leased slots were never evicted"
        c.release(r)


def test_leased_objects_are_never_evicted(shared_small_daemon: DaemonProc) -> None:
    """The control for the test above: while a lease is held, the same pressure does not take its slots."""
    daemon = shared_small_daemon
    with Client(daemon.socket) as c:
        c.attach("ref-tiny")
        evictions = c.stats().forms["compressed"].evictions
        caches = caches_for(PROFILE, 5, 3)
        c.offload(tokens_for(5, 3, H), caches)
        r = c.lookup(tokens_for(5, 3, H))
        assert r.hit_tokens == 3 * H and not r.needs_load
        with Client(daemon.socket) as other:
            other.attach("ref-tiny")
            for seed in range(200, 240):
                other.offload(tokens_for(seed, 4, H), caches_for(PROFILE, seed, 4))
        assert compare(c, r, caches) > 0  # still the same bytes, read through the same slots
        assert c.stats().forms["compressed"].evictions > evictions  # the pressure was real
        c.release(r)


def test_bad_offload_and_reads_are_typed_errors(shared_daemon: DaemonProc) -> None:
    daemon = shared_daemon
    from kvtier.client import OutOfOrder
    from kvtier.wire.errors import BadRange, WrongType

    with Client(daemon.socket) as c:
        c.attach("ref-tiny")
        with pytest.raises(WrongType):
            c.offload(tokens_for(9, 2, H), {"c4": {0: torch.zeros(3)}})  # wrong size
        with pytest.raises(WrongType):
            c.offload(tokens_for(9, 2, H), {"nope": {0: torch.zeros(3)}})
        with pytest.raises(BadRange):  # block 5 of a 2-block prompt
            c.offload(tokens_for(9, 2, H), {"c4": {5: torch.zeros(PROFILE.layout(PROFILE.group("c4")).shape)}})
        r = c.lookup(tokens_for(9, 2, H))
        with pytest.raises(OutOfOrder):
            c.read(r, "c4", 0)  # RECOMPUTE: nothing to read
        c.release(r)
        with pytest.raises(OutOfOrder):
            c.load(r)  # released
        assert c.stats().daemon.health == "ok"
    assert np.array_equal(tokens_for(9, 2, H), tokens_for(9, 2, H))
