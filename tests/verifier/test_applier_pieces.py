"""A decision of many records never holds the daemon's writers back for its whole length (issue 43): on the
applier's thread its write transactions end at the next item once another thread waits for the write lock, and in
any case after `PIECE_S` (`kvtier.store.gil.Piece`), so a durable write of the same process commits between two
pieces instead of waiting for the decision. Off the applier's thread (a verifier with no daemon) a decision stays one
transaction. A tombstone prune that finds nothing takes no write lock at all."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch
import xxhash

from kvtier.core import CacheForm, VersionKey
from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore, StoreConfig
from kvtier.store.decisions import Drop, DropIf, PruneTombstones
from kvtier.store.gil import PIECE_S, DurableFirst, Piece, applying
from kvtier.store.index import IndexEntry, RecordState, encode_key, pack_time, unpack_time
from kvtier.store.record import Codec

VK = VersionKey("pieces", "w0", "abi", "comp", "idx", "fp8")
DIGEST = b"P" * 16
RECORDS = 50_000  # a decision far longer than a durable write: with one transaction, every write waits it out
DEADLINE_S = 120.0  # a thread that never finishes fails the test, not the suite


def _index_rows(store: DiskStore, ns: bytes, n: int) -> list[bytes]:
    """`n` index entries (no record bytes behind them: a drop reads the index only), in one transaction."""
    keys = [encode_key(ObjectKey(ns, xxhash.xxh3_128_digest(b"k%d" % i), "c", CacheForm.COMPRESSED)) for i in range(n)]
    index = store.index

    def put(txn) -> None:
        for i, k in enumerate(keys):
            e = IndexEntry(
                RecordState.LIVE, CacheForm.COMPRESSED, Codec.NONE, 0, 0, 4096, 64, 64, bytes(16), DIGEST, i, 0
            )
            txn.put(k, e.pack(), db=index.obj)

    index.update(put)
    return keys


def _open(tmp_path: Path) -> tuple[DiskStore, bytes]:
    store = DiskStore(str(tmp_path / "store"), StoreConfig(io_backend="buffered"), writer=True)
    return store, store.register_namespace(VK)


def _drop_on_applier(store: DiskStore, keys: list[bytes], done: list[float]) -> None:
    with applying():  # as the daemon's decision applier thread
        store.apply_decision(Drop([DropIf(k) for k in keys], tombstone=True))
    done.append(time.monotonic())


def test_durable_writes_commit_while_a_long_decision_is_applied(tmp_path: Path) -> None:
    store, ns = _open(tmp_path)
    try:
        keys = _index_rows(store, ns, 2 * RECORDS)
        t0 = time.monotonic()  # the reference: the same decision's length in one transaction (no daemon)
        store.apply_decision(Drop([DropIf(k) for k in keys[:RECORDS]], tombstone=True))
        whole_s = time.monotonic() - t0
        commits: list[float] = []  # when each piece of the applier's decision committed
        store.observe(lambda change, ks: commits.append(time.monotonic()) if change == "removed" else None)
        done: list[float] = []
        writes: list[tuple[float, float]] = []
        applier = threading.Thread(target=_drop_on_applier, args=(store, keys[RECORDS:], done))
        payload = torch.zeros(4096, dtype=torch.uint8)
        deadline = time.monotonic() + DEADLINE_S
        applier.start()
        i = 0
        while applier.is_alive():  # durable writes (segment synced, then committed) for as long as the drop runs
            assert time.monotonic() < deadline, "the decision never finished"
            i += 1
            k = ObjectKey(ns, xxhash.xxh3_128_digest(b"w%d" % i), "c", CacheForm.COMPRESSED)
            t = time.monotonic()
            store.store(k, payload, DIGEST)
            writes.append((t, time.monotonic()))
        applier.join()
        store.observe(None)
        # In one transaction, a write that comes while the decision's body runs commits only after it: it waits
        # for about the reference's length. In pieces, its commit finds the lock free at the applier's next item.
        longest = max(b - a for a, b in writes)
        assert longest < whole_s / 2, f"a durable write waited {longest:.3f}s beside a {whole_s:.3f}s decision"
        assert len(commits) >= 2, "the decision was applied in one transaction beside durable writes"
        between = [b - a for a, b in writes if a >= commits[0] and b <= commits[-1]]
        assert len(between) >= 3, f"{len(between)} durable writes committed during the decision"
        with store.index.read() as txn:  # and the decision was applied whole
            assert all(txn.get(k, db=store.index.obj) is None for k in keys)
            assert all(txn.get(k, db=store.index.gone) is not None for k in keys)
    finally:
        store.close()


def _commits_of_drop(store: DiskStore, keys: list[bytes], on_applier: bool) -> int:
    told: list[int] = []
    store.observe(lambda change, ks: told.append(len(ks)) if change == "removed" else None)
    try:
        if on_applier:
            with applying():
                n = store.apply_decision(Drop([DropIf(k) for k in keys]))
        else:
            n = store.apply_decision(Drop([DropIf(k) for k in keys]))
    finally:
        store.observe(None)
    assert n == len(keys) == sum(told)  # every record dropped, each told once
    return len(told)


def test_a_decision_is_cut_by_time_on_the_applier_only(tmp_path: Path) -> None:
    store, ns = _open(tmp_path)
    try:
        keys = _index_rows(store, ns, RECORDS)
        half = len(keys) // 2
        t0 = time.monotonic()
        assert _commits_of_drop(store, keys[:half], on_applier=False) == 1  # no daemon: one transaction
        alone_s = time.monotonic() - t0
        assert alone_s > 2 * PIECE_S, "the decision is too short here to need cutting: use more records"
        assert _commits_of_drop(store, keys[half:], on_applier=True) >= 2  # no batch to wait for: cut by time
    finally:
        store.close()


def test_a_prune_that_finds_nothing_takes_no_write_lock(tmp_path: Path) -> None:
    store, _ = _open(tmp_path)
    try:
        index = store.index
        fresh = b"f" * 33 + b"c"
        index.update(lambda txn: txn.put(fresh, pack_time(time.time()), db=index.gone))
        done = threading.Event()
        got: list[tuple[int, bytes]] = []

        def prune() -> None:
            got.append(store.prune_tombstones(time.time() - 3600.0))
            done.set()

        txn = index.env.begin(write=True)  # another writer holds the lock throughout
        try:
            _in_thread(prune)
            assert done.wait(DEADLINE_S), "a prune with nothing to prune waited for the write lock"
            assert got == [(0, b"")]
        finally:
            txn.abort()
    finally:
        store.close()


def test_the_applier_deletes_only_the_named_tombstones_that_are_still_expired(tmp_path: Path) -> None:
    """The verifier scans for expired tombstones and sends their keys; one of them evicted again since (a new
    tombstone) stays, and so does a key it did not name."""
    store, _ = _open(tmp_path)
    try:
        index = store.index
        old, again, unnamed = (bytes([c]) * 33 + b"c" for c in b"oau")
        long_ago = pack_time(time.time() - 7200.0)

        def put(txn: lmdb.Transaction) -> None:
            for k in (old, again, unnamed):
                txn.put(k, long_ago, db=index.gone)

        index.update(put)
        index.update(lambda txn: txn.put(again, pack_time(time.time()), db=index.gone))  # evicted again
        with applying():
            assert store.apply_decision(PruneTombstones(time.time() - 3600.0, [old, again])) == 1
        with index.read() as r:
            assert r.get(old, db=index.gone) is None
            assert r.get(again, db=index.gone) is not None and r.get(unnamed, db=index.gone) is not None
    finally:
        store.close()


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_piece_ends_once_another_thread_waits_for_the_write_lock() -> None:
    writers = DurableFirst()
    with applying():
        piece = Piece(writers, budget_s=3600.0)
        assert not piece.over() and not piece.over()  # nobody waits: it goes on
        waiting, release = threading.Event(), threading.Event()

        def other_writer() -> None:
            with writers.wanting():  # as Index.update around its wait for the lock
                waiting.set()
                release.wait(DEADLINE_S)

        t = _in_thread(other_writer)
        assert waiting.wait(DEADLINE_S)
        assert piece.over()  # ends at this item
        assert not Piece(writers, budget_s=3600.0).over()  # a new piece always does its first item
        assert not Piece(writers, budget_s=0.0).over()
        release.set()
        t.join(DEADLINE_S)
    assert not Piece(writers, budget_s=0.0).over()  # off the applier's thread: never


def test_the_hold_back_waits_only_for_the_batches_under_way_when_it_came() -> None:
    """Under back-to-back durable batches the applier still gets its transaction in between."""
    writers = DurableFirst(max_wait_s=DEADLINE_S)
    first_open, first_end, second_open, second_end = (threading.Event() for _ in range(4))

    def batch(opened: threading.Event, end: threading.Event) -> None:
        with writers.durable():
            opened.set()
            end.wait(DEADLINE_S)

    _in_thread(lambda: batch(first_open, first_end))
    assert first_open.wait(DEADLINE_S)
    through = threading.Event()

    def applier() -> None:
        with applying():
            writers.before_write()
        through.set()

    _in_thread(applier)
    deadline = time.monotonic() + DEADLINE_S
    while writers.held_back == 0:  # the applier waits for the first batch
        assert time.monotonic() < deadline
        time.sleep(0.001)
    _in_thread(lambda: batch(second_open, second_end))
    assert second_open.wait(DEADLINE_S)
    assert not through.is_set()
    first_end.set()  # the second batch is still under way: it came after the applier, so it does not hold it
    assert through.wait(DEADLINE_S / 2), "the applier waited for a batch that began after it"
    assert writers.under_way
    second_end.set()


def _writes_beside(worker: threading.Thread, store: DiskStore, ns: bytes) -> int:
    """Durable writes, one after another, for as long as `worker` runs; how many committed while it still ran."""
    payload = torch.zeros(4096, dtype=torch.uint8)
    deadline = time.monotonic() + DEADLINE_S
    during = i = 0
    while worker.is_alive():
        assert time.monotonic() < deadline, "the background write never finished"
        i += 1
        store.store(ObjectKey(ns, xxhash.xxh3_128_digest(b"b%d" % i), "c", CacheForm.COMPRESSED), payload, DIGEST)
        during += worker.is_alive()
    worker.join()
    return during


def test_with_an_observer_a_piece_ends_once_a_durable_write_waits_for_its_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With KV events on, a piece's commit and a write's commit take turns reporting to the observer (in commit
    order), and the piece holds its turn from its first item: a write that waits for the turn must end the piece as
    one waiting for LMDB's write lock does, not wait for the piece's whole length."""
    monkeypatch.setattr(Piece.__init__, "__defaults__", (3600.0,))  # no time bound: only a waiting writer ends it
    store, ns = _open(tmp_path)
    try:
        keys = _index_rows(store, ns, RECORDS)
        removed: list[int] = []
        store.observe(lambda change, ks: removed.append(len(ks)) if change == "removed" else None)
        done: list[float] = []
        applier = _in_thread(lambda: _drop_on_applier(store, keys, done))
        during = _writes_beside(applier, store, ns)
        store.observe(None)
        assert during >= 3, f"{during} durable writes committed while the decision was applied"
        assert len(removed) >= 2 and sum(removed) == RECORDS  # in pieces, and whole
    finally:
        store.close()


def test_a_large_access_time_flush_goes_in_pieces_beside_durable_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's access-time thread writes with the applier's manners: a flush of many keys does not hold the
    write lock, and durable writes with it, for its whole length."""
    monkeypatch.setattr(Piece.__init__, "__defaults__", (3600.0,))  # no time bound: only a waiting writer ends it
    store, ns = _open(tmp_path)
    try:
        keys = _index_rows(store, ns, RECORDS)
        store._atimes.touch(keys)  # as loads of that many records note them
        noted = time.time()

        def flush() -> None:
            with applying():  # as the access-time thread runs it
                store.flush_atimes()

        during = _writes_beside(_in_thread(flush), store, ns)
        assert during >= 3, f"{during} durable writes committed while the access times were written"
        with store.index.read() as txn:  # and every access time was written
            assert all(unpack_time(txn.get(k, db=store.index.atime)) <= noted for k in keys)
            assert min(unpack_time(txn.get(k, db=store.index.atime)) for k in keys) > noted - 60
    finally:
        store.close()
