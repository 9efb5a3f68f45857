"""kill -9 of the verifier mid-sweep and mid-eviction: the store stays consistent and a restart finishes the job."""

from __future__ import annotations

import signal

from kvtier.core import CacheForm, Reason
from kvtier.store import DiskStore, QuarantineReason, RecordState, StoreConfig
from kvtier.store.record import record_length
from support.corrupt import flip_payload_bit
from support.verifier_helpers import VK, assert_consistent, entries, load, populate, start_verifier, stop, wait_for


def _doc(root: str) -> dict:
    with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
        return s.meta_doc("verifier") or {}


def test_kill_mid_sweep_then_restart_resumes_and_finds_late_corruption(tmp_path) -> None:
    root = str(tmp_path / "store")
    recs = populate(root, [(VK, f"r{i}", CacheForm.COMPRESSED, 60_000) for i in range(120)], segment_bytes=2 << 20)
    with DiskStore(root) as s:
        assert all(
            r.reason is Reason.OK for r in s.verify_many([r.key for r in recs])
        )  # nothing dirty: only the sweep reads
        es = entries(s)
    last = max(es, key=lambda k: (k.namespace, k.block_hash))  # the sweep walks key order: this one comes last
    flip_payload_bit(root, es[last], 5, 2)  # bit rot after verification
    proc = start_verifier(root, "--rate", "1500000", "--batch-records", "8")
    try:
        saved = wait_for(
            lambda: (d := _doc(root).get("sweep", {})).get("in_progress") and d.get("records", 0) >= 24 and d,
            40.0,
            proc,
            "sweep under way",
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert saved["records"] < len(recs), "killed mid-sweep"
    assert_consistent(root)
    with DiskStore(root) as s:
        assert s.records([last])[0].entry.state is RecordState.LIVE  # not reached yet
    proc = start_verifier(root, "--rate", "0")
    try:
        done = wait_for(
            lambda: (d := _doc(root)).get("actions", {}).get("sweeps", 0) >= 1 and d, 40.0, proc, "sweep finished"
        )
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert done["sweep"]["started_at"] == saved["started_at"], "the restarted verifier resumed the sweep, not a new one"
    assert done["sweep"]["records"] >= len(recs)
    with DiskStore(root) as s:
        assert s.records([last])[0].entry.quarantine is QuarantineReason.PAYLOAD
        good = [r for r in recs if r.key != last]
        assert all(why is Reason.OK and ok for why, ok in load(s, good))
    assert_consistent(root)


def test_kill_mid_eviction_then_restart_finishes(tmp_path) -> None:
    root = str(tmp_path / "store")
    n, size = 400, 4000
    rec_len = record_length(size)
    budget = 100 * rec_len
    recs = populate(
        root,
        [(VK, f"e{i}", (CacheForm.COMPRESSED, CacheForm.SWA)[i % 2], size) for i in range(n)],
        segment_bytes=512 << 10,
        budget_bytes=budget,
    )
    # populate published the budget only after writing: the store is four times over it
    proc = start_verifier(root, "--batch-records", "2")
    poll = DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True)
    try:
        used = wait_for(lambda: (u := poll.stats()["record_bytes"]) < n * rec_len and u, 40.0, proc, "eviction started")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        poll.close()
    assert used > 0.85 * budget, "killed mid-eviction"
    assert_consistent(root)
    proc = start_verifier(root)
    try:

        def finished() -> bool:
            # compaction writes the survivors into the verifier's own relocation segment, which stays open (unsealed,
            # flock held) for its next compaction while it runs: no *emptied* segment may remain
            with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
                return s.stats()["record_bytes"] <= 0.85 * budget and not any(
                    e.referenced == 0 for e in s.segments().values()
                )

        # the verifier runs at nice 19: on CPUs that the other test worker keeps busy this takes tens of seconds
        wait_for(finished, 120.0, proc, "eviction done and emptied segments unlinked")
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert_consistent(root)
    with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
        assert all(e.sealed for e in s.segments().values()), "a stopped verifier seals its relocation segment"
    with DiskStore(root) as s:
        left = set(entries(s))
        kept = [r for r in recs if r.key in left]
        assert kept and all(why is Reason.OK and ok for why, ok in load(s, kept))
