"""What a durable offload waits for behind the applier's commit (issue 43): the write lock covers a commit's data
sync, not the sync of its meta page, which `Index.update` does after the lock is free; every update is still
durable when it returns. The applier holds its next commit back while a durable batch is under way."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvtier.store.gil import applying
from kvtier.store.index import Index

DEADLINE_S = 10.0  # a writer blocked on the lock never returns: far above a commit on a loaded machine


def test_the_meta_sync_is_left_out_of_the_commit(tmp_path: Any) -> None:
    index = Index(str(tmp_path))
    try:
        assert index.env.flags()["metasync"] is False  # the commit itself syncs its data pages only
        assert index.env.flags()["sync"] is True
    finally:
        index.close()


def test_another_writer_commits_while_an_update_syncs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one update syncs (the applier's decision), a second writer (a durable offload's commit) takes the
    write lock and commits: it does not wait for the first one's sync."""
    index = Index(str(tmp_path))
    try:
        real_sync = index.sync
        syncs: list[str] = []
        inner_done = threading.Event()
        errors: list[BaseException] = []

        def other_writer() -> None:
            try:
                index.update(lambda txn: txn.put(b"offload", b"1", db=index.meta))
                inner_done.set()
            except BaseException as exc:  # reported to the test below
                errors.append(exc)

        def sync() -> None:
            name = threading.current_thread().name
            syncs.append(name)
            if name == "first":  # inside the first update's sync: the lock must be free for the other writer
                t = threading.Thread(target=other_writer, name="second")
                t.start()
                t.join(DEADLINE_S)
                assert inner_done.is_set(), "the second writer waited for the first update's sync"
            real_sync()

        monkeypatch.setattr(index, "sync", sync)
        outcome: list[bool] = []

        def first() -> None:
            try:
                index.update(lambda txn: txn.put(b"decision", b"1", db=index.meta))
                outcome.append(True)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=first, name="first")
        t.start()
        t.join(2 * DEADLINE_S)
        assert not errors, errors
        assert outcome == [True]
        assert syncs == ["first", "second"]  # each update synced once, after its commit
        with index.read() as txn:
            assert txn.get(b"decision", db=index.meta) == b"1"
            assert txn.get(b"offload", db=index.meta) == b"1"
    finally:
        index.close()


def _applier_update(index: Index, done: threading.Event) -> None:
    with applying():  # as the daemon's decision applier
        index.update(lambda txn: txn.put(b"decision", b"1", db=index.meta))
    done.set()


def test_the_applier_holds_back_while_a_durable_batch_is_under_way(tmp_path: Any) -> None:
    """A decision's commit waits for the durable batch (segment sync, then commit) under way in the process, so the
    batch's commit does not find the write lock held by the decision's commit and its sync."""
    index = Index(str(tmp_path))
    try:
        done = threading.Event()
        with index.writers.durable():
            t = threading.Thread(target=_applier_update, args=(index, done))
            t.start()
            deadline = time.monotonic() + DEADLINE_S
            while index.writers.held_back == 0:  # the applier reached its write and waits for the batch
                assert time.monotonic() < deadline, "the applier never waited for the durable batch"
                time.sleep(0.001)
            assert not done.is_set()
            index.update(lambda txn: txn.put(b"offload", b"1", db=index.meta))  # the batch's commit: lock free
            assert not done.is_set()
        t.join(DEADLINE_S)
        assert done.is_set()
        with index.read() as txn:
            assert txn.get(b"decision", db=index.meta) == b"1"
    finally:
        index.close()


def test_the_applier_waits_a_bounded_time_and_other_threads_not_at_all(tmp_path: Any) -> None:
    index = Index(str(tmp_path))
    index.writers.max_wait_s = 0.2
    try:
        with index.writers.durable():
            index.update(lambda txn: txn.put(b"other", b"1", db=index.meta))  # not the applier: never held back
            assert index.writers.held_back == 0
            done = threading.Event()
            t = threading.Thread(target=_applier_update, args=(index, done))
            t.start()
            t.join(DEADLINE_S)  # the batch never ends here: the applier goes on after max_wait_s
            assert done.is_set() and index.writers.held_back == 1
    finally:
        index.close()
