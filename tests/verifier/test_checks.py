"""Layout digests against the namespace's version key; watchdog hints; the daemon's supervisor starting us."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import torch
import xxhash

from kvtier.core import CacheForm, Reason
from kvtier.core.config import embedded_default
from kvtier.core.profile import load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.daemon.service import default_verifier_command
from kvtier.daemon.supervisor import Supervisor
from kvtier.store import DiskStore, QuarantineReason, RecordState, StoreConfig
from kvtier.verifier import LayoutOracle, Verifier, VerifierSettings, verifier_status
from support.procs import ended
from support.verifier_helpers import (
    REPO,
    VK,
    assert_consistent,
    entries,
    payload,
    populate,
    start_verifier,
    stop,
    wait_for,
)


def test_layout_digest_that_contradicts_the_version_key_is_quarantined(tmp_path) -> None:
    root = str(tmp_path / "store")
    prof = load_profile("ref-tiny")
    vk = prof.version.bumped(weights_digest="w-test")  # same model and layout family: checkable
    good_digest = dataclasses.replace(prof, version=vk).layout(prof.group("c4")).digest
    with DiskStore(root, writer=True) as w:
        ns = w.register_namespace(vk)
        good, bad = (ObjectKey(ns, xxhash.xxh3_128_digest(t), "c4", prof.group("c4").form) for t in (b"g", b"b"))
        w.store(good, payload("g", 4096), good_digest)
        w.store(bad, payload("b", 4096), b"X" * 16)  # a writer bug: a digest its namespace does not imply
    assert LayoutOracle.load().expected(VK, "c4") is None  # an unknown model is not checkable
    with DiskStore(root) as s:
        v = Verifier(s, VerifierSettings())
        assert v.verify_dirty()
        states = {k: e for k, e in entries(s).items()}
        assert states[good].state is RecordState.LIVE and states[good].verified_at > 0
        assert states[bad].quarantine is QuarantineReason.LAYOUT
        out = torch.zeros(4096, dtype=torch.uint8)
        assert s.load_into([LoadRequest(bad, out, b"X" * 16)]) == [Reason.ABI_MISMATCH]


def test_a_watchdog_hint_wakes_an_idle_verifier(tmp_path) -> None:
    root = str(tmp_path / "store")
    populate(root, [(VK, "first", CacheForm.COMPRESSED, 5000)])
    proc = start_verifier(root, "--poll", "60", "--maintenance-interval", "600", "--sweep-interval", "600")
    try:

        def idle_and_clean() -> bool:
            with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
                return verifier_status(s)["phase"] == "idle" and not s.iter_dirty()

        wait_for(idle_and_clean, 30.0, proc, "first record verified, verifier idle")
        recs = populate(root, [(VK, "second", CacheForm.COMPRESSED, 5000)])
        t0 = time.monotonic()

        def verified() -> bool:
            with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
                return s.records([recs[0].key])[0].entry.verified_at > 0

        wait_for(verified, 20.0, proc, "the new record verified long before the 60 s poll")
        assert time.monotonic() - t0 < 20.0
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err


def test_daemon_supervisor_runs_the_verifier_and_reads_its_state(tmp_path) -> None:
    root = tmp_path / "store"
    populate(str(root), [])
    cfg = dataclasses.replace(
        embedded_default(tmp_path), store=dataclasses.replace(embedded_default(tmp_path).store, root=root)
    )
    cmd = default_verifier_command(cfg)
    assert cmd[:3] == [sys.executable, "-m", "kvtier.cli"] and cmd[3:5] == ["verifier", "run"]
    sup = Supervisor("verifier", cmd)
    sup.start()
    try:

        def ready() -> dict | None:
            with DiskStore(str(root), StoreConfig(io_backend="buffered"), readonly=True) as s:
                st = verifier_status(s)
            return st if st["running"] and st["ready"] else None

        st = wait_for(ready, 30.0, what="the supervised verifier reports ready")
        assert st["verifier_pid"] == sup.state().pid and isinstance(st["actions"], dict)
    finally:
        code = sup.stop(20.0)
    assert code == 0  # SIGTERM is a clean stop
    with DiskStore(str(root), StoreConfig(io_backend="buffered"), readonly=True) as s:
        st = verifier_status(s)
    assert st["phase"] == "stopped" and not st["running"]
    assert_consistent(str(root))
    assert os.path.isdir(root / "segments")


def _running_pid(root: str) -> int | None:
    with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
        st = verifier_status(s)
    return st["verifier_pid"] if st["running"] and st["ready"] else None


def test_a_second_verifier_waits_for_the_first_then_takes_over(tmp_path) -> None:
    """One verifier per store (verifier.lock): a second one waits, and runs once the first has gone."""
    root = str(tmp_path / "store")
    populate(root, [(VK, "r", CacheForm.COMPRESSED, 5000)])
    first = start_verifier(root)
    second = None
    try:
        assert wait_for(lambda: _running_pid(root), 30.0, first, "the first verifier is ready") == first.pid
        second = start_verifier(root)
        line = wait_for(lambda: second.stderr.readline(), 30.0, second, "the second verifier says it waits")
        while "another verifier holds" not in line:
            line = wait_for(lambda: second.stderr.readline(), 30.0, second, "the second verifier says it waits")
        assert _running_pid(root) == first.pid
        assert stop(first) is not None and first.returncode == 0
        wait_for(lambda: _running_pid(root) == second.pid, 30.0, second, "the second verifier takes over")
    finally:
        stop(first)
        if second is not None:
            stop(second)
    assert second.returncode == 0


def test_a_supervised_verifier_ends_with_its_daemon(tmp_path) -> None:
    """kill -9 of the supervising daemon leaves no orphan verifier (PR_SET_PDEATHSIG via KVTIER_PARENT_PID)."""
    root = str(tmp_path / "store")
    populate(root, [])
    cmd = [sys.executable, "-m", "kvtier.cli", "verifier", "run", "--store", root]
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom kvtier.daemon.supervisor import Supervisor\n"
            f"Supervisor('verifier', {cmd!r}).start()\nsys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        pid = wait_for(lambda: _running_pid(root), 30.0, None, "the supervised verifier is ready")
        daemon.kill()
        daemon.wait(10)

        wait_for(lambda: ended(pid), 20.0, None, f"verifier {pid} exits after its daemon was killed")
    finally:
        if daemon.poll() is None:
            daemon.kill()
