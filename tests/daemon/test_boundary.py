"""Never wrong bytes across the process boundary (issue 18), through a real daemon and client processes:
leases that expire only for clients that stop renewing, reads re-validated against the shared generation
table, pools no client can write, durable acknowledgements that hold after the daemon is gone, and a
write-back that reports (and exits non-zero on) what it cannot persist."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from kvtier.client import Client, NotDurable, StaleHandle
from kvtier.core.forms import Route
from kvtier.core.not_durable import NotDurableCause
from kvtier.core.profile import load_profile
from kvtier.wire import messages as P
from support.boundary import fill_until_stale, start_reserver, write_into_sealed_slot
from support.daemon import DaemonProc, child_env
from support.promlint import problems
from support.workload import caches_for, tokens_for

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens
SMALL_POOLS = 'compressed = "64KiB"\nindexer = "32KiB"\ntail = "256KiB"\nswa = "256KiB"\n'
GROUP = "c4"  # a history group: every block of a prefix has one


def _offload(c: Client, seed: int, blocks: int, durable: bool = False):
    return c.offload(tokens_for(seed, blocks, H), caches_for(PROFILE, seed, blocks), durable=durable)


def _want(seed: int, blocks: int, block: int) -> torch.Tensor:
    return caches_for(PROFILE, seed, blocks)[GROUP][block]


@pytest.fixture(scope="module")
def lease_daemon(tmp_path_factory: pytest.TempPathFactory):
    """One daemon for the lease and seal tests: small pools and one-second leases. Each test writes prompts of its
    own seeds (the expired lease 1, the renewing client 2, the sealed slot 3, the short seal 5; the fills 100+ and
    1000+) and asserts only on those, so what an earlier test left in the pools changes none of them."""
    d = DaemonProc(tmp_path_factory.mktemp("leases"), top_toml="lease_ttl_s = 1\n", pools=SMALL_POOLS)
    try:
        yield d
    finally:
        d.terminate()


def test_an_expired_lease_reads_stale_never_another_prefix(lease_daemon: DaemonProc) -> None:
    d = lease_daemon
    with Client(d.socket, heartbeat=False) as a, Client(d.socket) as b:
        a.attach("ref-tiny")
        b.attach("ref-tiny")
        _offload(a, 1, 2)
        result = a.lookup(tokens_for(1, 2, H))
        assert result.check_vector.route(GROUP, 0) is Route.REUSE
        out = torch.empty_like(_want(1, 2, 0))
        assert torch.equal(a.read_into(result, GROUP, 0, out), _want(1, 2, 0))
        view = a.read(result, GROUP, 0)
        # A stops renewing; B fills the pool with other prefixes until A's slot is reused
        fill_until_stale(lambda seed: _offload(b, seed, 4), a, result, GROUP, 0)
        with pytest.raises(StaleHandle):
            a.read_into(result, GROUP, 0, out)
        with pytest.raises(StaleHandle):
            a.read(result, GROUP, 0)
        # the earlier view now shows other bytes: it was documented valid only while the lease held
        assert not torch.equal(view, _want(1, 2, 0))


def test_a_renewing_client_keeps_its_slots_however_long(lease_daemon: DaemonProc) -> None:
    d = lease_daemon
    with Client(d.socket) as a, Client(d.socket) as b:  # A's heartbeat renews every ttl/3
        a.attach("ref-tiny")
        b.attach("ref-tiny")
        _offload(a, 2, 2)
        result = a.lookup(tokens_for(2, 2, H))
        started, seed = time.monotonic(), 100
        while time.monotonic() - started < 4:  # four TTLs of B filling the pool
            _offload(b, seed, 4)
            seed += 1
        assert seed - 100 > 8, "B did not write enough to press on the pool"
        for block in (0, 1):
            out = torch.empty_like(_want(2, 2, block))
            assert torch.equal(a.read_into(result, GROUP, block, out), _want(2, 2, block))
        assert a.renew() > 0


def test_no_client_can_write_a_sealed_slot(lease_daemon: DaemonProc, tmp_path: Path) -> None:
    d = lease_daemon
    with Client(d.socket) as a:
        a.attach("ref-tiny")
        _offload(a, 3, 2)
        write_into_sealed_slot(d.socket, tokens_for(3, 2, H), GROUP, 0, tmp_path)
        result = a.lookup(tokens_for(3, 2, H))
        out = torch.empty_like(_want(3, 2, 0))
        assert torch.equal(a.read_into(result, GROUP, 0, out), _want(3, 2, 0))


def test_seal_checks_the_bytes_that_really_arrived(lease_daemon: DaemonProc) -> None:
    """A client that claims whole objects but stages fewer bytes gets partial_block; nothing is cached."""
    import os

    d = lease_daemon
    with Client(d.socket) as c:
        c.attach("ref-tiny")
        hashes = c.hashes(tokens_for(5, 1, H))
        reply: P.OffloadOk = c._call(P.Offload(hashes, [GROUP], [[0]]))
        nbytes = PROFILE.group(GROUP).object_bytes(H)
        fd = os.memfd_create("short", os.MFD_ALLOW_SEALING)
        os.write(fd, b"\1" * (nbytes // 2))
        try:
            with pytest.raises(Exception, match="sealed after 1024 of 2048 bytes"):
                c._call(P.Seal(reply.offload_id, False, [nbytes]), send_fds=[fd])
        finally:
            os.close(fd)
        assert c.lookup(tokens_for(5, 1, H)).check_vector.route(GROUP, 0) is Route.RECOMPUTE


# durable_wait_s: with A stopped, B's offload waits all of it and then reports A's objects (so short: the wait's end
# is what is proved); with A killed, it bounds only the daemon's noticing the closed connection (so long).
@pytest.mark.parametrize(("a_state", "wait_s"), [("stopped", 2), ("killed", 8)])
def test_durable_covers_objects_another_connection_reserved(tmp_path: Path, a_state: str, wait_s: int) -> None:
    store = tmp_path / "store"
    d = DaemonProc(tmp_path, top_toml=f"durable_wait_s = {wait_s}\n", pools=SMALL_POOLS, store_root=store)
    a, reserved = start_reserver(d.socket, tokens_for(7, 4, H), ["c4", "c16"], tmp_path)
    try:
        assert reserved == 8
        a.send_signal(signal.SIGSTOP if a_state == "stopped" else signal.SIGKILL)
        if a_state == "killed":
            a.wait()
        with Client(d.socket) as b:
            b.attach("ref-tiny")
            rep = _offload(b, 7, 4, durable=True)
        named = sum(len(v) for v in caches_for(PROFILE, 7, 4).values())
        assert rep.durable + rep.not_durable == named
        if a_state == "stopped":  # A's 8 reservations never sealed: reported, not acknowledged
            assert rep.not_durable == 8 and not rep.persisted
            assert any(w.cause is NotDurableCause.RESERVED_ELSEWHERE for w in rep.why), rep.reasons
        else:  # A's reservations went with its connection: B wrote them itself
            assert rep.not_durable == 0 and rep.persisted, rep.reasons
    finally:
        a.kill()
        a.wait()
        d.close()  # SIGKILL: only what was committed survives
    (tmp_path / "again").mkdir()
    d2 = DaemonProc(tmp_path / "again", store_root=store)
    try:
        with Client(d2.socket) as c:
            c.attach("ref-tiny")
            result = c.lookup(tokens_for(7, 4, H))
            c.load(result)
            caches = caches_for(PROFILE, 7, 4)
            served = 0
            for block, group, _f, route, _r in result.check_vector.entries():
                if route is Route.REUSE:
                    out = torch.empty_like(caches[group][block])
                    assert torch.equal(c.read_into(result, group, block, out), caches[group][block])
                    served += 1
            if a_state == "killed":  # every object acknowledged durable is served, bitwise, by a later daemon
                assert result.hit_tokens == 4 * H and served == rep.durable
    finally:
        d2.terminate()


def test_write_back_blocked_for_one_form_is_reported_and_fails_the_drain(tmp_path: Path) -> None:
    d = DaemonProc(
        tmp_path,
        pools=SMALL_POOLS,
        extra_toml='[store.quota_bytes]\nswa = "4KiB"\n',  # no swa record (16 KiB) ever fits
    )
    try:
        with Client(d.socket) as c:
            c.attach("ref-tiny")
            for seed in range(3):
                _offload(c, seed, 2)
            with pytest.raises(NotDurable, match="swa") as err:
                c.flush(timeout_s=20)
            assert err.value.pending > 0
            assert {w.cause for w in err.value.why} == {NotDurableCause.STORE_REFUSED}, err.value.reasons
            doc = c.stats()
            assert doc.store["persist_queue"] == err.value.pending
            assert doc.store["forms"]["compressed"]["records"] > 0  # the other forms kept persisting
            assert doc.daemon is not None and doc.daemon.health.startswith("degraded: write-back blocked")
            _exported_blocked(d, doc.daemon.metrics, err.value.pending)
            rep = _offload(c, 50, 2, durable=True)
            assert not rep.persisted and rep.not_durable == len(caches_for(PROFILE, 50, 2)["swa"])
            assert [w.cause for w in rep.why] == [NotDurableCause.STORE_REFUSED], rep.reasons
            assert rep.durable == sum(len(v) for v in caches_for(PROFILE, 50, 2).values()) - rep.not_durable
        assert d.terminate() != 0
        assert "acknowledged objects could not be persisted" in (tmp_path / "daemon.log").read_text()
    finally:
        d.close()


def _exported_blocked(d: DaemonProc, metrics_address: str, stuck: int) -> None:
    """The blocked swa write-back in the Prometheus exposition (linted) and in `kvtier status` (exit 1)."""
    body = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    assert problems(body) == [], problems(body)
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line[:1] != "#"}
    assert samples['kvtier_write_back_stuck_objects{form="swa",profile="ref-tiny"}'] == stuck
    assert samples['kvtier_write_back_backlog_objects{form="swa",profile="ref-tiny"}'] >= stuck
    assert samples.get('kvtier_write_back_stuck_objects{form="compressed",profile="ref-tiny"}', 0) == 0
    assert samples["kvtier_write_back_failed_passes_total"] >= 1 and samples["kvtier_healthy"] == 0
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", "--socket", str(d.socket)],
        env=child_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr
    assert f"write-back blocked  ref-tiny/swa: {stuck} objects waiting" in out.stdout, out.stdout


def test_config_show_lists_admission(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text("[admission]\nmax_entries = 64\nmin_form_share = 0.1\nrebalance_every = 16\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "config", "show", "--config", str(cfg), "--json"],
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    admission = json.loads(out)["admission"]
    assert {k: admission[k] for k in ("max_entries", "min_form_share", "rebalance_every")} == {
        "max_entries": 64,
        "min_form_share": 0.1,
        "rebalance_every": 16,
    }
    assert admission["max_recovering"] == 4096  # the recovery caps live in the same table
