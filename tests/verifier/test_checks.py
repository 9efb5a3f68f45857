"""Layout digests against the namespace's version key; watchdog hints; the daemon's supervisor starting us."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import xxhash

from kvtier.core import CacheForm, Reason
from kvtier.core.profile import load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.daemon.config import default_verifier_command, embedded_default
from kvtier.daemon.supervisor import Supervisor
from kvtier.store import DiskStore, QuarantineReason, RecordState, StoreConfig
from kvtier.verifier import LayoutOracle, Verifier, VerifierSettings, verifier_status
from verifier_helpers import VK, assert_consistent, entries, payload, populate, start_verifier, stop, wait_for


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
    cfg = dataclasses.replace(embedded_default(tmp_path), store=dataclasses.replace(embedded_default(tmp_path).store, root=root))
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
