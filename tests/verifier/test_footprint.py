"""What the verifier costs the store's readers: its scheduling and I/O class, a sweep that writes nothing for
records already verified, a rate limit whose burst stays short after an idle spell, and an exit that needs
little of the CPU its low priority leaves it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from kvtier.core import CacheForm
from kvtier.store import DiskStore, QuarantineReason, RecordState, segments
from kvtier.verifier import Verifier, VerifierSettings, open_store, throttle, verifier_status
from kvtier.verifier.throttle import RateLimiter
from support.corrupt import flip_payload_bit
from support.verifier_helpers import REPO, VK, entries, populate, start_verifier, stop, wait_for


def test_the_verifier_process_runs_every_thread_at_batch_nice_19_and_idle_io_priority(tmp_path) -> None:
    root = str(tmp_path / "store")
    populate(root, [(VK, "a", CacheForm.COMPRESSED, 5000)])
    proc = start_verifier(root)
    try:

        def working() -> bool:
            with DiskStore(root, readonly=True) as s:
                return verifier_status(s)["phase"] not in ("never ran", "starting")

        wait_for(working, 30.0, proc, "verifier started")
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) > 1  # its read pool and watchdog threads, started after the priority was lowered
        for tid in tids:
            assert os.sched_getscheduler(tid) == os.SCHED_BATCH, tid  # never SCHED_IDLE: it must not starve
            assert os.getpriority(os.PRIO_PROCESS, tid) == 19, tid
        if shutil.which("ionice"):
            shown = subprocess.run(["ionice", "-p", str(proc.pid)], capture_output=True, text=True).stdout
            assert shown.strip() == "idle", shown
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err


_LOWER = (
    "import os, resource; from kvtier.verifier.priority import lower_priority; "
    "print(lower_priority()['policy'], os.sched_getscheduler(0) == os.SCHED_IDLE, "
    "resource.getrlimit(resource.RLIMIT_NICE)[1])"
)


def test_a_verifier_started_sched_idle_leaves_it_where_it_may_or_says_it_stays() -> None:
    """An unprivileged process leaves SCHED_IDLE only within RLIMIT_NICE: without CAP_SYS_NICE (dropped from the
    bounding set) the verifier raises its soft limit as far as the hard one allows, and where that is not far
    enough it reports "idle" rather than a policy it does not have; with the capability it takes SCHED_BATCH."""
    if not (shutil.which("setpriv") and shutil.which("chrt")):
        pytest.fail("setpriv and chrt (util-linux) are needed to start a process SCHED_IDLE without CAP_SYS_NICE")
    capable = subprocess.run(
        ["chrt", "-i", "0", sys.executable, "-c", _LOWER], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert capable.stdout.split()[:2] == ["batch", "False"], capable.stdout + capable.stderr
    unprivileged = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_nice", "chrt", "-i", "0", sys.executable, "-c", _LOWER],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    policy, still_idle, hard = unprivileged.stdout.split()
    if int(hard) >= 1:  # a hard RLIMIT_NICE that admits nice 19: the soft limit is raised and SCHED_IDLE left
        assert (policy, still_idle) == ("batch", "False"), unprivileged.stdout
    else:
        assert (policy, still_idle) == ("idle", "True"), unprivileged.stdout
        assert "cannot leave SCHED_IDLE" in unprivileged.stderr


def _cpu_s(pid: int) -> float:
    """User + system CPU of the whole process (a zombie keeps its count until it is reaped)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_stopping_verifier_needs_under_a_tenth_of_a_cpu_second(tmp_path) -> None:
    """Nice 19 leaves the verifier little CPU while the machine is busy, its exit included: the exit skips the
    interpreter's teardown once the store is closed."""
    root = str(tmp_path / "store")
    populate(root, [(VK, "a", CacheForm.COMPRESSED, 5000)])
    proc = start_verifier(root, "--poll", "60", "--maintenance-interval", "600", "--sweep-interval", "600")
    try:

        def idle_and_clean() -> bool:
            with DiskStore(root, readonly=True) as s:
                return verifier_status(s)["phase"] == "idle" and not s.iter_dirty()

        wait_for(idle_and_clean, 30.0, proc, "record verified, verifier idle")
        before = _cpu_s(proc.pid)
        proc.send_signal(signal.SIGTERM)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: its count still reads
        spent = _cpu_s(proc.pid) - before
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    with DiskStore(root, readonly=True) as s:
        assert verifier_status(s)["phase"] == "stopped"  # a clean stop, status saved, not a kill
    assert spent < 0.1, spent


def test_the_verifier_verifies_evicts_and_compacts_without_loading_torch(tmp_path) -> None:
    """It only reads, checks and moves bytes: loading torch for that cost it over a CPU-second at every start, in the
    moments its work competes with the engines' (and hundreds of MiB). Its memory maps, once it has verified,
    evicted and relocated records, hold no torch library."""
    root = str(tmp_path / "store")
    recs = populate(root, [(VK, f"r{i}", CacheForm.COMPRESSED, 20_000) for i in range(60)], segment_bytes=128 << 10)
    with DiskStore(root, writer=True) as s:
        s.pin([r.key for r in recs[::3]], 3600.0)  # eviction leaves the segments a third live: they are compacted
        s.set_limits(s.stats()["record_bytes"] // 2, {})
    proc = start_verifier(root)
    try:

        def did_everything() -> bool:
            with DiskStore(root, readonly=True) as s:
                done = verifier_status(s)["actions"]
            return all(done.get(a, 0) > 0 for a in ("verified", "evicted", "relocated"))

        wait_for(did_everything, 60.0, proc, "records verified, evicted and relocated")
        with open(f"/proc/{proc.pid}/maps") as f:
            torch_maps = [line.split()[-1] for line in f if "torch" in line]
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert torch_maps == []


def test_a_sweep_reads_verified_records_without_rewriting_them_and_quarantines_what_fails(tmp_path) -> None:
    root = str(tmp_path / "store")
    recs = populate(root, [(VK, f"r{i}", CacheForm.COMPRESSED, 20_000) for i in range(12)])
    with DiskStore(root) as s:
        v = Verifier(s, VerifierSettings(rate_bytes_per_s=0, read_bytes=50_000))
        while v.verify_dirty():
            pass
        stamped = entries(s)
        assert all(e.verified_at > 0 for e in stamped.values()) and not s.iter_dirty()
        bad = recs[5].key
        flip_payload_bit(root, stamped[bad], 100, 3)
        before = v.actions["verified"]
        v.sweep_step()
        while v.sweep.in_progress:
            v.sweep_step()
        after = entries(s)
    assert v.actions["verified"] - before == len(recs) - 1
    assert after[bad].state is RecordState.QUARANTINED and after[bad].quarantine is QuarantineReason.PAYLOAD
    assert v.actions["quarantined"] == 1
    # the good records' entries are byte for byte what the first verification stamped: no write per sweep batch
    assert {k: e for k, e in after.items() if k != bad} == {k: e for k, e in stamped.items() if k != bad}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _Stop(threading.Event):
    """Records how long the limiter asked to wait, and lets that time pass on the fake clock."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock
        self.waited: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waited.append(timeout)
        self.clock.now += timeout
        return False


def test_after_an_idle_spell_the_limiter_lets_through_a_tenth_of_a_second_not_a_second(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(throttle, "time", clock)
    stop_event = _Stop(clock)
    rate = 10_000_000
    lim = RateLimiter(rate, stop_event)
    clock.now += 60.0  # idle (or paused) for a minute: the bucket is full, and holds 0.1 s of the rate
    assert lim.take(rate // 10) and stop_event.waited == []
    assert lim.take(rate // 2) and abs(stop_event.waited[-1] - 0.5) < 1e-9  # no saved-up second to spend at once
    clock.now += 60.0
    assert lim.take(rate) and abs(stop_event.waited[-1] - 0.9) < 1e-9


class _Probe:
    def __init__(self) -> None:
        self.is_busy = False

    def busy(self) -> bool:
        return self.is_busy


def test_while_the_disk_is_busy_the_limiter_paces_at_the_busy_rate(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(throttle, "time", clock)
    stop_event = _Stop(clock)
    rate, busy_rate = 10_000_000, 1_000_000
    probe = _Probe()
    lim = RateLimiter(rate, stop_event, busy_rate, probe)
    clock.now += 60.0
    assert lim.take(rate // 10 + rate // 2) and abs(stop_event.waited[-1] - 0.5) < 1e-9 and not lim.paced_busy
    probe.is_busy = True  # the same bytes now cost ten times as long ...
    assert lim.take(rate // 2) and abs(stop_event.waited[-1] - 5.0) < 1e-9 and lim.paced_busy
    clock.now += 60.0  # ... and an idle spell saves up a tenth of a second of the busy rate, not of the full one
    assert lim.take(busy_rate // 10) and len(stop_event.waited) == 2
    assert lim.take(busy_rate) and abs(stop_event.waited[-1] - 1.0) < 1e-9
    probe.is_busy = False
    assert lim.take(rate) and abs(stop_event.waited[-1] - 1.0) < 1e-9 and not lim.paced_busy
    lim.set_rate(rate, 2 * rate)  # a busy rate above the rate is the rate
    probe.is_busy = True
    assert lim.take(rate) and abs(stop_event.waited[-1] - 1.0) < 1e-9 and not lim.paced_busy
    lim.set_rate(0, busy_rate)  # 0: unlimited, busy or not
    assert lim.take(100 * rate) and len(stop_event.waited) == 5


def test_while_the_disk_is_busy_each_read_or_copy_is_a_tenth_of_a_second_of_the_busy_rate(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(throttle, "time", clock)
    probe = _Probe()
    lim = RateLimiter(10_000_000, _Stop(clock), 1_000_000, probe)
    assert lim.burst(8 << 20) == 8 << 20  # idle disk: the configured batch
    probe.is_busy = True
    assert lim.burst(8 << 20) == 100_000 and lim.burst(4096) == 4096
    lim.set_rate(0, 1_000_000)  # unlimited: nothing is paced, nothing shrinks
    assert lim.burst(8 << 20) == 8 << 20


def test_while_the_disk_is_busy_compaction_copies_in_bursts_under_one_sync_and_commit_per_batch(
    tmp_path, monkeypatch
) -> None:
    """A sync and a commit are device flushes the readers feel: the paced bursts of one batch share them."""
    clock = _Clock()
    monkeypatch.setattr(throttle, "time", clock)
    root = str(tmp_path / "store")
    recs = populate(root, [(VK, f"r{i}", CacheForm.COMPRESSED, 5000) for i in range(48)], segment_bytes=64 << 10)
    syncs: list[int] = []
    real_sync = segments.Appender.sync_batch
    monkeypatch.setattr(segments.Appender, "sync_batch", lambda app: (syncs.append(1), real_sync(app))[1])
    with open_store(root) as s:
        survivors = [r.key for r in recs[::4]]
        assert s.drop([r.key for r in recs if r.key not in survivors]) == 36  # every sealed segment is 1/4 live
        relocations: list[list[int]] = []  # the records of each burst, per relocation
        real_relocate = s.relocate

        def relocate(batches):
            drawn: list[int] = []
            relocations.append(drawn)
            return real_relocate(drawn.append(len(b)) or b for b in batches)

        monkeypatch.setattr(s, "relocate", relocate)
        v = Verifier(s, VerifierSettings(rate_bytes_per_s=0, batch_records=4, orphan_grace_s=3600))
        probe = _Probe()
        probe.is_busy = True
        v.cleaner.limiter = RateLimiter(10_000_000, _Stop(clock), 1_000, probe)  # a burst is one record
        before = {k: s.records([k])[0].entry.segment for k in survivors}
        v.maintain()
        moved = [k for k in survivors if s.records([k])[0].entry.segment != before[k]]
        assert len(moved) >= 8 and v.actions["relocated"] == len(moved)  # the sealed segments' survivors
        assert all(n == 1 for drawn in relocations for n in drawn)  # paced one record at a time ...
        assert max(len(drawn) for drawn in relocations) == 4  # ... four bursts to a commit ...
        assert len(syncs) == len(relocations) < sum(len(drawn) for drawn in relocations)  # ... and to a sync
        assert all(r.reason.name == "OK" for r in s.verify_many(survivors))  # every byte where its entry says
