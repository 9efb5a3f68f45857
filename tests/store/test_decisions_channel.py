"""The channel the verifier's decisions take to the daemon (kvtier.store.channel), on a real store: applied in the
applier's own transactions, conditional on what the sender saw, answered with why when they cannot be, and
never waited on by the sender once no applier holds the lock."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from kvtier.core import Reason
from kvtier.store import (
    DaemonUnavailable,
    DecisionClient,
    DecisionServer,
    DiskStore,
    DropIf,
    RecordState,
    StoreError,
    encode_key,
)
from kvtier.store.channel import SenderStopping, applier_pid, spool_dir
from kvtier.store.decisions import Drop, PutDoc, Quarantine, SealAbandoned, decode_decision
from kvtier.store.errors import QuarantineReason
from kvtier.store.segments import SEGMENTS_DIR, allocate_segment, segment_name
from support.store_helpers import DIGEST, VK, make_key, make_payload


@pytest.fixture
def served(tmp_path):
    root = str(tmp_path / "store")
    store = DiskStore(root, writer=True)
    ns = store.register_namespace(VK)
    keys = [make_key(ns, f"d{i}") for i in range(4)]
    store.store_many([(k, make_payload(f"d{i}", 1000), DIGEST) for i, k in enumerate(keys)])
    server = DecisionServer(root, store.apply_decision)
    server.start()
    yield root, store, server, keys
    server.stop()
    store.close()


def test_decisions_are_applied_only_to_the_records_the_sender_saw(served) -> None:
    root, store, server, keys = served
    client = DecisionClient(root)
    seq = {r.key: r.entry.seq for r in store.records(keys)}
    stale = DropIf(encode_key(keys[0]), seq[keys[0]] + 1)  # a record that changed since it was seen
    live = int(RecordState.LIVE)
    assert client.send(Drop([stale, DropIf(encode_key(keys[1]), seq[keys[1]], live)], tombstone=True)) == 1
    assert client.send(Quarantine(encode_key(keys[2]), int(QuarantineReason.PAYLOAD))) is True
    assert store.has(keys, [DIGEST] * 4) == [Reason.OK, Reason.EVICTED, Reason.CORRUPT, Reason.OK]
    assert server.applied == 2 and server.failed == 0
    assert not [n for n in os.listdir(spool_dir(root)) if n != "applier.lock"]  # request and reply both gone


def test_an_unreadable_request_is_answered_and_the_applier_goes_on(served) -> None:
    root, _, _, keys = served
    client = DecisionClient(root)
    name = f"{os.getpid()}-999999999999"
    with open(os.path.join(spool_dir(root), name + ".req"), "wb") as f:
        f.write(b"\xc1 not msgpack")
    deadline = time.monotonic() + 10
    while not os.path.exists(os.path.join(spool_dir(root), name + ".rep")):
        assert time.monotonic() < deadline, "the applier never answered"
        time.sleep(0.01)  # polling a condition with a deadline
    os.unlink(os.path.join(spool_dir(root), name + ".rep"))
    with pytest.raises(StoreError, match="could not apply"):
        client.send(Quarantine(b"\0" * 3, 1))  # a key that does not decode: answered with why, not applied
    assert client.send(Quarantine(encode_key(keys[3]), int(QuarantineReason.PAYLOAD))) is True


def test_what_a_dead_sender_left_is_removed_at_start(tmp_path) -> None:
    root = str(tmp_path / "store")
    DiskStore(root, writer=True).close()
    os.makedirs(spool_dir(root))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = [f".{dead.stdout.strip()}-000000000001", f"{dead.stdout.strip()}-000000000002.rep"]
    for name in left:
        open(os.path.join(spool_dir(root), name), "wb").close()
    with DiskStore(root, writer=True) as store:
        server = DecisionServer(root, store.apply_decision)
        server.start()
        try:
            assert not set(left) & set(os.listdir(spool_dir(root)))
        finally:
            server.stop()


def test_a_sender_with_no_applier_is_told_so_not_left_waiting(tmp_path) -> None:
    root = str(tmp_path / "store")
    DiskStore(root, writer=True).close()
    os.makedirs(spool_dir(root))
    assert applier_pid(root) is None
    client = DecisionClient(root, timeout_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        client.send(Quarantine(b"k", 1))
    assert time.monotonic() - t0 < 5.0  # the applier's lock is probed, not the deadline waited out
    assert not [n for n in os.listdir(spool_dir(root)) if n.endswith(".req")]  # its request taken back
    t1 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="not sending more"):  # and it stops sending for a while
        client.send(Quarantine(b"k", 1))
    assert time.monotonic() - t1 < 0.1


def test_another_process_sees_the_applier_by_its_lock(served) -> None:
    root, *_ = served
    code = f"from kvtier.store.channel import applier_pid; print(applier_pid({root!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == os.getpid()


_HOLD = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_EX); "
_HOLD += "print('held', flush=True); sys.stdin.read()"


@pytest.fixture
def unanswered(tmp_path):
    """A store whose applier lock another process holds and whose requests nobody answers: a daemon whose
    applier thread is gone or stuck."""
    root = str(tmp_path / "store")
    DiskStore(root, writer=True).close()
    os.makedirs(spool_dir(root))
    lock = os.path.join(spool_dir(root), "applier.lock")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        assert applier_pid(root) == holder.pid
        yield root
    finally:
        holder.kill()
        holder.wait()


def _requests(root: str) -> list[str]:
    return [n for n in os.listdir(spool_dir(root)) if n.endswith(".req")]


def test_a_sender_left_unanswered_stops_sending_for_a_while(unanswered) -> None:
    client = DecisionClient(unanswered, timeout_s=0.5)
    with pytest.raises(DaemonUnavailable, match="did not apply a decision within"):
        client.send(Quarantine(b"k", 1))
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="not sending more"):
        client.send(Quarantine(b"k", 1))
    assert time.monotonic() - t0 < 0.1  # refused at once, not another timeout waited out
    assert _requests(unanswered) == []  # nothing written, and the unanswered request taken back


def test_a_stop_cuts_a_reply_wait_short_and_refuses_later_sends(unanswered) -> None:
    stop = threading.Event()
    client = DecisionClient(unanswered, timeout_s=30.0, stop=stop, stop_grace_s=0.3)
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(SenderStopping):
        client.send(Quarantine(b"k", 1))
    assert 0.2 <= time.monotonic() - t0 < 5.0  # the grace after the stop, not the 30 s timeout
    t1 = time.monotonic()
    with pytest.raises(SenderStopping):
        client.send(Quarantine(b"k", 1))
    assert time.monotonic() - t1 < 0.1 and _requests(unanswered) == []


def test_a_stopping_sender_still_gets_a_live_applier_s_reply_within_its_grace(served) -> None:
    root, _, server, keys = served
    stop = threading.Event()
    stop.set()
    client = DecisionClient(root, stop=stop, stop_grace_s=5.0)
    assert client.send(Quarantine(encode_key(keys[0]), int(QuarantineReason.PAYLOAD))) is True  # its last status
    assert server.applied == 1


_SEAL_PASS = """
import sys
from kvtier.store import DecisionClient, DiskStore
store = DiskStore(sys.argv[1], decisions=DecisionClient(sys.argv[1]), take_load_resources=False)
print(store.seal_abandoned_segments())
store.close()
"""


def _seal_pass(root: str) -> int:
    """A maintenance pass's sealing from another process, as the verifier's: how many it sealed."""
    done = subprocess.run([sys.executable, "-c", _SEAL_PASS, root], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_abandoned_segments_are_found_by_the_sender_and_only_those_are_sent(served) -> None:
    """The daemon never scans the segment table for the verifier: a pass that finds nothing sends nothing, and one
    that finds a segment with no appender names it, and the applier seals it."""
    root, store, server, _ = served
    assert _seal_pass(root) == 0  # the daemon's own segment is held by its appender
    assert server.applied == 0
    seg_id = store.index.update(lambda txn: allocate_segment(store.index, txn))  # its appender died before
    assert _seal_pass(root) == 1  # creating the file
    assert server.applied == 1 and store.segments()[seg_id].sealed
    assert _seal_pass(root) == 0 and server.applied == 1


def test_a_segment_locked_since_the_sender_probed_it_is_not_sealed(served) -> None:
    """The applier probes each named segment again: one allocated and not yet created when the sender looked, whose
    appender has created and locked it since, stays unsealed."""
    root, store, _, _ = served
    seg_id = store.index.update(lambda txn: allocate_segment(store.index, txn))
    appender = store.backend.open(os.path.join(root, SEGMENTS_DIR, segment_name(seg_id)), create=True, write=True)
    try:
        assert appender.try_lock()
        assert DecisionClient(root).send(SealAbandoned([seg_id])) == 0
        assert not store.segments()[seg_id].sealed
    finally:
        appender.close()
    assert DecisionClient(root).send(SealAbandoned([seg_id])) == 1  # its appender gone now
    assert store.segments()[seg_id].sealed


def test_an_older_verifier_s_seal_request_naming_no_segment_is_answered(served) -> None:
    """A verifier from before the sender found the segments sends the decision with no field (msgpack
    {"type": "seal_abandoned"}): answered with 0, not refused, so its maintenance pass goes on."""
    root, store, server, _ = served
    seg_id = store.index.update(lambda txn: allocate_segment(store.index, txn))
    assert decode_decision(msgspec.msgpack.encode({"type": "seal_abandoned"})) == SealAbandoned([])
    assert DecisionClient(root).send(SealAbandoned()) == 0
    assert server.failed == 0 and not store.segments()[seg_id].sealed


_STATUS = """
import sys
from kvtier.store import DecisionClient, DiskStore
store = DiskStore(sys.argv[1], decisions=DecisionClient(sys.argv[1]), take_load_resources=False)
store.put_meta_doc("verifier", {"phase": "sweeping", "heartbeat_at": float(sys.argv[2])})
store.close()
"""


def test_the_verifier_s_status_is_a_file_it_replaces_not_a_decision(served) -> None:
    """Its status and heartbeat, published every few seconds, cost the daemon no index commit and its disk no
    flush: the sender writes the file itself, and the daemon reads it."""
    root, store, server, _ = served
    subprocess.run([sys.executable, "-c", _STATUS, root, "123.5"], check=True)
    assert server.applied == 0
    assert store.meta_doc("verifier") == {"phase": "sweeping", "heartbeat_at": 123.5}
    assert sorted(n for n in os.listdir(root) if "verifier" in n) == ["verifier.json"]
    with store.index.read() as txn:
        assert txn.get(b"doc:verifier", db=store.index.meta) is None


def test_a_status_file_cut_short_reads_as_none_and_an_older_verifier_s_decision_writes_it(served) -> None:
    """What a crash can leave (the file renamed before its bytes reached the disk) reads as no status, not an
    error; a verifier from before the file sends its status as a decision, which the daemon writes there."""
    root, store, server, _ = served
    with open(os.path.join(root, "verifier.json"), "wb") as f:
        f.write(b'{"phase": "swe')
    assert store.meta_doc("verifier") is None
    assert DecisionClient(root).send(PutDoc("verifier", b'{"phase": "idle"}')) is None
    assert server.failed == 0 and store.meta_doc("verifier") == {"phase": "idle"}
