"""The fault matrix's process-boundary rows (issue 18): a lease that expires under a slow reader, a client
writing into a sealed slot, a reserver killed under a durable offload, one form's disk quota full, and the
daemon frozen past a client's timeout. Each row still ends bitwise (a recompute from the hit B got) or
RECOMPUTE with its reason; the mechanics are tests/support/boundary.py's, shared with tests/daemon."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.client import Client, DaemonTimeout, LookupResult, NotDurable, NotDurableCause, StaleHandle
from kvtier.core.forms import Reason, Route
from kvtier.refmodel import RefModel
from kvtier.refmodel.engine import RefEngine
from kvtier.wire import messages as P
from support.boundary import fill_until_stale, frozen, start_reserver, write_into_sealed_slot
from support.daemon import SMALL_POOLS, DaemonProc
from support.e2e_harness import PROFILE, H, Oracle
from support.fault_cases import BLOCKS, CP, a_prompt, b_prompt, bitwise, file_row, offload, serve
from support.fault_table import FaultRows
from support.workload import caches_for, tokens_for


def _restart(d: DaemonProc, tmp: Path) -> DaemonProc:
    """SIGKILL the daemon (a cold pool: only what the store committed survives) and start another on its store."""
    d.proc.send_signal(signal.SIGKILL)
    d.close()
    return DaemonProc(tmp)


class _SlowReader(Client):
    """Engine B's client: between its lookup and its first read it is slow (and does not renew its leases)."""

    def __init__(self, *args, slow: Callable[[Client, LookupResult, str, int], object], **kwargs) -> None:
        super().__init__(*args, heartbeat=False, **kwargs)
        self.slow: Callable[[Client, LookupResult, str, int], object] | None = slow

    def read(self, result, group, block):
        if self.slow is not None:
            slow, self.slow = self.slow, None
            slow(self, result, group, block)
        return super().read(result, group, block)


def test_lease_expired_under_a_slow_reader(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    seed = 71
    d = DaemonProc(tmp_path, top_toml="lease_ttl_s = 1\n", pools=SMALL_POOLS)
    try:
        offload(d, seed)
        with Client(d.socket, name="engine C") as c:
            c.attach(PROFILE.name)

            def other_prefixes(s: int) -> None:
                c.offload(tokens_for(s, 4, H), caches_for(PROFILE, s, 4))

            def slow(client: Client, result: LookupResult, group: str, block: int) -> None:
                fill_until_stale(other_prefixes, client, result, group, block)

            tokens = b_prompt(seed)
            with _SlowReader(d.socket, name="engine B", slow=slow) as client:
                client.attach(PROFILE.name)
                engine = RefEngine(client, RefModel(PROFILE), checkpoint_every=CP)
                with pytest.raises(StaleHandle):  # never C's bytes
                    engine.restore_and_continue(tokens)
        res = serve(d, tokens)  # looked up again: A's prefix comes back from the store
        assert res.hit_tokens == BLOCKS * H
        file_row(
            fault_table,
            "lease expired under a slow reader (StaleHandle, then looked up again)",
            res,
            "c4",
            0,
            "StaleHandle; then " + bitwise(res, tokens, oracle),
        )
    finally:
        d.close()


def test_client_writes_into_a_sealed_slot(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    seed = 72
    d = DaemonProc(tmp_path)
    try:
        offload(d, seed)
        write_into_sealed_slot(d.socket, a_prompt(seed), "c4", 0, tmp_path)
        tokens = b_prompt(seed)
        res = serve(d, tokens)
        assert res.hit_tokens == BLOCKS * H and res.loaded_objects == 0  # served from the pool it tried to write
        file_row(
            fault_table,
            "another client writes into a sealed slot",
            res,
            "c4",
            0,
            "the write faulted (SIGSEGV); " + bitwise(res, tokens, oracle),
        )
    finally:
        d.close()


class _KillsBeforeSeal(Client):
    """Engine A's client: after its offload reserved what it could (the reserver's objects skipped), and
    before it seals, the reserver is killed mid-copy."""

    def __init__(self, *args, kill: Callable[[], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kill: Callable[[], None] | None = kill

    def _call(self, req, *args, **kwargs):
        if isinstance(req, P.Seal) and self.kill is not None:
            kill, self.kill = self.kill, None
            kill()
        return super()._call(req, *args, **kwargs)


def test_reserver_killed_under_a_durable_offload(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    seed = 73
    d = DaemonProc(tmp_path, top_toml="durable_wait_s = 8\n")
    try:
        reserver, reserved = start_reserver(d.socket, a_prompt(seed), ["c4", "c16"], tmp_path)
        assert reserved == 2 * BLOCKS

        def kill() -> None:
            reserver.kill()  # mid-copy: its reservations are abandoned while A's durable offload stands
            reserver.wait()

        with _KillsBeforeSeal(d.socket, name="engine A", kill=kill) as client:
            client.attach(PROFILE.name)
            try:
                rep = RefEngine(client, RefModel(PROFILE), checkpoint_every=CP).prefill_and_offload(
                    a_prompt(seed), durable=True
                )
                acked, note = rep.persisted, f"durable, {reserved} abandoned objects offloaded again"
                assert rep.skipped == reserved and rep.written == sum(rep.objects[f]["objects"] for f in rep.objects)
            except NotDurable as exc:  # the other acceptable end: reported, never acknowledged
                acked, note = False, f"reported not durable: {'; '.join(exc.reasons)}"
        assert client.kill is None and reserver.returncode is not None
        d = _restart(d, tmp_path)
        tokens = b_prompt(seed)
        res = serve(d, tokens)
        if acked:
            assert res.hit_tokens == BLOCKS * H  # every object acknowledged durable is served after the restart
        file_row(
            fault_table,
            "reserver killed -9 under a durable offload, daemon restarted",
            res,
            "c4",
            0,
            f"{note}; " + bitwise(res, tokens, oracle),
        )
    finally:
        d.close()


def test_one_forms_disk_quota_full(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    seed = 74
    quota = '[store.quota_bytes]\nswa = "4KiB"\n'  # no swa record ever fits
    d = DaemonProc(tmp_path, extra_toml=quota)
    try:
        with Client(d.socket, name="engine A") as client:
            client.attach(PROFILE.name)
            engine = RefEngine(client, RefModel(PROFILE), checkpoint_every=CP)
            with pytest.raises(NotDurable) as refused:
                engine.prefill_and_offload(a_prompt(seed), durable=True)
            assert {w.cause for w in refused.value.why} == {NotDurableCause.STORE_REFUSED}
            with pytest.raises(NotDurable, match="swa") as flushed:
                client.flush(timeout_s=20)
            assert {w.cause for w in flushed.value.why} == {NotDurableCause.STORE_REFUSED}
            forms = client.stats().store["forms"]
            assert forms["compressed"]["records"] > 0 and forms["indexer"]["records"] > 0  # the others persisted
            assert forms["swa"]["records"] == 0
        d = _restart(d, tmp_path)  # the swa objects were never acknowledged, and are gone with the pool
        tokens = b_prompt(seed)
        res = serve(d, tokens)
        cv = res.final_cv
        assert (cv.route("swa", BLOCKS - 1), cv.reason("swa", BLOCKS - 1)) == (Route.RECOMPUTE, Reason.MISSING)
        file_row(
            fault_table,
            "swa disk quota full (flush raised store_refused; other forms persisted)",
            res,
            "swa",
            BLOCKS - 1,
            bitwise(res, tokens, oracle),
        )
    finally:
        d.close()


def test_daemon_frozen_past_a_clients_timeout(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    seeds = (75, 76)
    d = DaemonProc(tmp_path)
    try:
        offload(d, *seeds)
        with Client(d.socket, name="engine B", timeout_s=1.0) as client:
            client.attach(PROFILE.name)
            engine = RefEngine(client, RefModel(PROFILE), checkpoint_every=CP)
            with frozen(d), pytest.raises(DaemonTimeout):
                engine.restore_and_continue(b_prompt(seeds[0]))
            results = {s: engine.restore_and_continue(b_prompt(s)) for s in (seeds[1], seeds[0])}
        for s, res in results.items():  # each call answered its own request: its prefix, bitwise
            assert res.hit_tokens == BLOCKS * H
            outcome = bitwise(res, b_prompt(s), oracle)
        file_row(
            fault_table,
            "daemon frozen (SIGSTOP) past the client's timeout",
            results[seeds[0]],
            "c4",
            0,
            f"DaemonTimeout; then each later call its own prefix: {outcome}",
        )
    finally:
        d.close()
