"""What a durable offload waits for behind the applier's commit (issue 43): the write lock covers a commit's data
sync, not the sync of its meta page, which `Index.update` does after the lock is free; every update is still
durable when it returns."""

from __future__ import annotations

import threading
from typing import Any

import pytest

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
