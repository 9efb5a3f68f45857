"""A version rollout by reload, under client load: a new weights digest in `[versions.ref-tiny]`, then SIGHUP.

The new namespace is live at once for clients that attach after it; a client attached before keeps its
leases but its lookups answer RECOMPUTE `stale_version` and its offloads are refused; the old namespace is
retired in the store and the verifier (its own process, as under systemd) reclaims its records to zero
while lookups keep being served (p99 reported before and during the reclaim).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvtier.client import Client
from kvtier.core.forms import Reason, Route
from kvtier.core.profile import load_profile
from kvtier.store import DiskStore, StoreConfig
from support.daemon import DaemonProc, child_env
from support.e2e_harness import Oracle, branch, engine_reports, prompt, run_engine, save_prompts, start_engine
from support.workload import caches_for, compare, tokens_for

BLOCKS = 4
NEW = "xxh3_128:rollout-2"
VERIFIER = [sys.executable, "-m", "kvtier.cli", "verifier", "run", "--poll", "0.1"]


def _namespace_entries(store_root: Path) -> dict[str, tuple[bool, int]]:
    """namespace hex -> (live, records) as the store's index has them now."""
    from kvtier.verifier.settings import VerifierSettings
    from kvtier.verifier.store_report import audit_store

    with DiskStore(str(store_root), StoreConfig(io_backend="buffered"), readonly=True) as s:
        report = audit_store(s, VerifierSettings())
    return {n.namespace.hex(): (n.live, sum(c.entries for c in n.forms.values())) for n in report.namespaces}


class Lookups:
    """An engine looking up its own written prefixes in a loop, timing each lookup; `reattach` makes it attach
    again (as an engine restarted on the new version would) and write its prefixes under the new namespace."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.profile = load_profile("ref-tiny")
        self.times: list[tuple[float, float]] = []  # (when, seconds)
        self.hits = 0
        self.stop = threading.Event()
        self.reattach = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _engine(self) -> Client:
        client = Client(self.socket_path, timeout_s=30)
        client.attach("ref-tiny")
        h = self.profile.hash_block_tokens
        for seed in range(1000, 1004):
            client.offload(tokens_for(seed, BLOCKS, h), caches_for(self.profile, seed, BLOCKS))
        return client

    def _run(self) -> None:
        client = self._engine()
        h = self.profile.hash_block_tokens
        n = 0
        while not self.stop.is_set():
            if self.reattach.is_set():
                self.reattach.clear()
                client.close()
                client = self._engine()
            n += 1
            started = time.monotonic()
            result = client.lookup(tokens_for(1000 + n % 4, BLOCKS, h))
            self.times.append((started, time.monotonic() - started))
            self.hits += result.hit_tokens == BLOCKS * h
            client.release(result)
        client.close()

    def p99(self, since: float, until: float) -> float:
        window = [s for t, s in self.times if since <= t < until]
        assert len(window) >= 20, f"only {len(window)} lookups in the window"
        return float(np.percentile(window, 99))


def test_rollout_by_reload(daemon: DaemonProc) -> None:
    profile = load_profile("ref-tiny")
    h = profile.hash_block_tokens
    old_ns = profile.version.namespace
    store_root = daemon.tmp / "store"
    work = daemon.tmp / "work"
    work.mkdir()
    a0 = prompt(500, 12 * h)  # seeds apart from the synthetic writers' (same seed, same tokens)
    save_prompts(work, {"a0": a0, "b0": branch(a0, 8 * h, 3, 50)})
    assert run_engine(daemon, work, "offload", "a0")["a0"]["persisted"]  # the reference model at the old version
    waiting = start_engine(daemon, work, "wait", "b0")  # an engine attached before the rollout, continuing after
    assert waiting.stdout is not None and old_ns.hex() in waiting.stdout.readline()
    with Client(daemon.socket) as writer:
        writer.attach("ref-tiny")
        assert writer.attachment.namespace == old_ns
        for seed in range(1, 9):
            rep = writer.offload(tokens_for(seed, BLOCKS, h), caches_for(profile, seed, BLOCKS), durable=True)
            assert rep.persisted
    records_before = _namespace_entries(store_root)[old_ns.hex()]
    assert records_before[0] and records_before[1] > 0

    old = Client(daemon.socket)
    old.attach("ref-tiny")
    held = old.lookup(tokens_for(1, BLOCKS, h))
    old.load(held)
    assert held.hit_tokens == BLOCKS * h

    load = Lookups(daemon.socket)
    load.thread.start()
    verifier = None
    try:
        started = time.monotonic()
        while len(load.times) < 60:  # a baseline of lookups before the rollout
            assert time.monotonic() - started < 60
            time.sleep(0.01)  # polling the load's progress
        t_switch = time.monotonic()
        daemon.config.write_text(daemon.config.read_text() + f'[versions.ref-tiny]\nweights_digest = "{NEW}"\n')
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_for("RELOADING=1")
        assert "reloaded" in daemon.wait_for("READY=1")
        new_ns = profile.version.bumped(weights_digest=NEW).namespace
        load.reattach.set()

        # the engine attached before: its leases stand and read its exact bytes; new lookups are stale_version
        assert compare(old, held, caches_for(profile, 1, BLOCKS)) > 0
        again = old.lookup(tokens_for(1, BLOCKS, h))
        assert again.hit_tokens == 0
        assert (again.check_vector.routes == Route.RECOMPUTE).all()
        assert (again.check_vector.reasons == Reason.STALE_VERSION).all()
        refused = old.offload(tokens_for(50, BLOCKS, h), caches_for(profile, 50, BLOCKS))
        assert refused.written == 0 and refused.refused > 0
        old.release(held)

        # the reference-model engine attached before: its lookups are RECOMPUTE stale_version, its output bitwise
        stale = engine_reports(daemon, waiting, "wait", stdin="go\n")["b0"]
        assert stale["hit_tokens"] == 0 and all(
            k.startswith("RECOMPUTE") for c in stale["routes_at_lookup"].values() for k in c
        )
        assert {r for row in stale["reasons"] for r in row} == {int(Reason.STALE_VERSION)}
        Oracle(profile).check_file(work, "b0", np.load(work / "b0.npy"), 0)
        # engines of the new version: nothing of the old one, then their own records, bitwise with the new model
        new_profile = dataclasses.replace(profile, version=profile.version.bumped(weights_digest=NEW))
        assert run_engine(daemon, work, "continue", "b0", weights=NEW)["b0"]["hit_tokens"] == 0
        assert run_engine(daemon, work, "offload", "a0", weights=NEW)["a0"]["persisted"]
        resumed = run_engine(daemon, work, "continue", "b0", weights=NEW)["b0"]
        assert resumed["hit_tokens"] == 8 * h
        Oracle(new_profile).check_file(work, "b0", np.load(work / "b0.npy"), resumed["hit_tokens"])

        # an engine attached after sees only the new namespace: the old prefixes are not there for it
        with Client(daemon.socket) as fresh:
            assert fresh.attach("ref-tiny").namespace == new_ns
            assert fresh.lookup(tokens_for(1, BLOCKS, h)).hit_tokens == 0
            rep = fresh.offload(tokens_for(60, BLOCKS, h), caches_for(profile, 60, BLOCKS), durable=True)
            assert rep.written > 0 and rep.persisted
            result = fresh.lookup(tokens_for(60, BLOCKS, h))
            assert result.hit_tokens == BLOCKS * h and compare(fresh, result, caches_for(profile, 60, BLOCKS)) > 0

        entries = _namespace_entries(store_root)
        assert entries[old_ns.hex()][0] is False and entries[new_ns.hex()][0] is True

        # the verifier reclaims the retired namespace in the background while lookups go on
        while load.reattach.is_set():  # the load engine runs on the new namespace before the reclaim starts
            time.sleep(0.01)  # polling the load thread
        t_reclaim = time.monotonic()
        verifier = subprocess.Popen(
            [*VERIFIER, "--store", str(store_root), "--sweep-interval", "0.5", "--maintenance-interval", "0.2"],
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 90
        while _namespace_entries(store_root).get(old_ns.hex(), (False, 0))[1] > 0:
            assert time.monotonic() < deadline, "the retired namespace's records were never reclaimed"
            assert verifier.poll() is None
            time.sleep(0.2)  # polling the store's index
        t_done = time.monotonic()
        with Client(daemon.socket) as c:  # the daemon's own view: the old namespace retired, its bytes gone
            shown = {n.namespace: n for n in c.stats().namespaces}
        assert shown[new_ns.hex()].state == "live"
        assert old_ns.hex() not in shown or (shown[old_ns.hex()].state, shown[old_ns.hex()].bytes) == ("retired", 0)
        time.sleep(0.3)  # let the lookup loop cover the end of the reclaim window
    finally:
        if waiting.poll() is None:
            waiting.kill()
        load.stop.set()
        load.thread.join(30)
        old.close()
        if verifier is not None:
            verifier.send_signal(signal.SIGTERM)
            verifier.wait(30)
    before = load.p99(0.0, t_switch)
    during = load.p99(t_reclaim, t_done + 0.3)
    print(json.dumps({"p99_lookup_before_s": before, "p99_lookup_during_reclaim_s": during}))
    assert during < max(10 * before, 0.25), (before, during)
    assert load.hits > 40  # the load engine's lookups hit its own prefixes, before and after the switch
    log = daemon.read_log()
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:4000]
