"""A refused write-back asks the store again only for what its room takes.

The store's budget and quota refusals say the room left and the bytes the batch needed (`OutOfRoom`). The
persister's smaller batches of a refused form start at what that room takes, and a store with room for none is not
asked again in that pass: on a full store each offload's pass used to try every form at 16, 8, 4, 2 and 1 objects,
each an admission refused by the same budget while the engines' loads and offloads waited for the daemon's GIL.
Real manager, real store, real persister thread; the stores' calls are counted.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.forms import CacheForm
from kvtier.daemon.persister import PERSIST_BATCH, Persister
from kvtier.gpu import CacheManager
from kvtier.store import DiskStore, StoreConfig, StoreFull
from kvtier.store.record import record_length
from support.gpuworld import PROFILE, budgets, hashes_of, key, payload, prompt, write

BLOCKS = 8  # history blocks written: 8 objects of each history group wait for write-back
TIMEOUT_S = 30.0
ONLY_INDEX = frozenset(set(CacheForm) - {CacheForm.INDEXER})  # a persist's `skip` that leaves the indexer form


class _Runtime:
    def __init__(self, manager: CacheManager) -> None:
        self.name = "ref-tiny"
        self.manager = manager


@contextlib.contextmanager
def _node(tmp_path: Path, config: StoreConfig) -> Iterator[tuple[DiskStore, CacheManager, list[list[CacheForm]]]]:
    """A store, a manager with BLOCKS history blocks sealed and not written back, and the forms of every
    `store_many` call that reaches the store (refused ones included)."""
    with DiskStore(str(tmp_path), config, writer=True) as store:
        store.register_namespace(PROFILE.version)
        m = CacheManager(PROFILE, budgets_bytes=budgets(PROFILE, 2 * BLOCKS), lower=store)
        try:
            assert write(m, hashes_of(m, prompt(5, BLOCKS)), range(BLOCKS), state_at=set()) > 0
            calls: list[list[CacheForm]] = []
            real = store.store_many

            def store_many(items):  # type: ignore[no-untyped-def]
                calls.append([k.form for k, _, _ in items])
                return real(items)

            store.store_many = store_many  # type: ignore[method-assign]
            yield store, m, calls
        finally:
            m.close()


def _wait_pass(persister: Persister) -> None:
    done, _ = persister.wait_pass(TIMEOUT_S)
    assert done


def _one_pass(m: CacheManager) -> Persister:
    persister = Persister([_Runtime(m)], depth=1 << 20)  # type: ignore[list-item]
    _wait_pass(persister)
    return persister


def _index_record_bytes() -> int:
    return record_length(payload(PROFILE, "c4_index", b"h" * 16, PROFILE.version.namespace).numel())


def test_a_full_store_is_asked_once_a_pass(tmp_path: Path) -> None:
    config = StoreConfig(io_backend="buffered", budget_bytes=_index_record_bytes())
    with _node(tmp_path, config) as (store, m, calls):
        assert m.persist_batch(1, skip=ONLY_INDEX).stored == 1  # the store is at its budget
        calls.clear()
        persister = _one_pass(m)
        try:
            forms = set(calls[0])
            # one batch of every form together, refused by the budget with no room at all: not each form alone
            # (the same budget refuses each), nor in smaller batches
            assert len(calls) == 1 and len(forms) > 1, [len(c) for c in calls]
            assert {form for _, form in persister.blocked} == {f.value for f in forms}
            assert all("budget" in why for why in persister.blocked.values())
            calls.clear()
            _wait_pass(persister)  # every pass offers the batch once: a cluster below takes refused objects too
            assert len(calls) == 1 and set(calls[0]) == forms
            assert store.stats()["records"] == 1
        finally:
            persister.stop(10.0)


def test_a_refused_form_is_tried_next_at_what_its_room_takes(tmp_path: Path) -> None:
    room = 3  # records of the indexer form that its quota takes
    config = StoreConfig(io_backend="buffered", form_quotas={CacheForm.INDEXER: room * _index_record_bytes()})
    with _node(tmp_path, config) as (_, m, calls):
        persister = _one_pass(m)
        try:
            indexer_alone = [len(c) for c in calls if set(c) == {CacheForm.INDEXER}]
            # the form's batch (the pool's pin share of it) refused alone, then exactly the room's 3 stored, then
            # 3 more refused with room for none: not asked again at 2 or 1
            assert indexer_alone[0] > room and indexer_alone[1:] == [room, room], [len(c) for c in calls]
            assert persister.backlog()["ref-tiny"] == {CacheForm.INDEXER.value: BLOCKS - room}
            assert "quota" in persister.blocked[("ref-tiny", CacheForm.INDEXER.value)]
        finally:
            persister.stop(10.0)


def _index_items(m: CacheManager, seed: int, n: int) -> list:
    hashes = hashes_of(m, prompt(seed, n))
    return [
        (key(m, h, "c4_index"), payload(PROFILE, "c4_index", h, m.namespace), m.layout_digest("c4_index"))
        for h in hashes
    ]


@pytest.mark.parametrize("limit", ["budget", "quota"])
def test_a_refusal_says_the_room_left_and_the_bytes_needed(tmp_path: Path, limit: str) -> None:
    one = _index_record_bytes()
    kw = {"budget_bytes": 2 * one} if limit == "budget" else {"form_quotas": {CacheForm.INDEXER: 2 * one}}
    with _node(tmp_path, StoreConfig(io_backend="buffered", **kw)) as (store, m, _):  # type: ignore[arg-type]
        assert m.persist_batch(1, skip=ONLY_INDEX).stored == 1  # one record in: room for one more
        outcome = m.persist_batch(4, skip=ONLY_INDEX)
        assert outcome.refused_objects == {CacheForm.INDEXER: 4} and outcome.out_of_room[CacheForm.INDEXER].fits(4) == 1
        with pytest.raises(StoreFull) as refused:
            store.store_many(_index_items(m, 9, 3))
        left = refused.value.left
        assert (left.limit.split(":")[0], left.room, left.needed) == (limit, one, 3 * one)
        assert left.fits(3) == 1 and store.stats()["records"] == 1


def test_refusals_keep_no_read_transaction_open(tmp_path: Path) -> None:
    """A refusal's traceback holds the store's frames and their read transactions: the write-back keeps what the
    store said (`RoomLeft`), never the error, or a daemon refused often runs out of LMDB's reader slots (the
    collector frees such cycles only now and then: off here, so a kept one shows)."""
    config = StoreConfig(io_backend="buffered", budget_bytes=_index_record_bytes())
    with _node(tmp_path, config) as (store, m, _):
        assert m.persist_batch(1, skip=ONLY_INDEX).stored == 1  # the store is at its budget
        readers = store.index.env.readers().count("\n")
        gc.disable()
        try:
            for _ in range(40):
                outcome = m.persist_batch(PERSIST_BATCH)
                assert outcome.failed and not outcome.stored
                assert m.persist_batch(2, skip=ONLY_INDEX).failed
            assert store.index.env.readers().count("\n") == readers
        finally:
            gc.enable()


def test_a_full_store_warns_once_not_once_a_batch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store at its budget refuses every round until the cleaner makes room: one warning per form when that
    starts, not a line per refused batch (a line per offload, while it lasts); one line when the form goes in again,
    with how many were refused meanwhile. A refusal for another reason warns again."""
    one = _index_record_bytes()
    config = StoreConfig(io_backend="buffered", budget_bytes=2 * one)
    with _node(tmp_path, config) as (store, m, _):
        assert m.persist_batch(2, skip=ONLY_INDEX).stored == 2  # the store is at its budget
        caplog.set_level(logging.DEBUG, logger="kvtier.gpu.writeback")
        for _ in range(5):
            assert m.persist_batch(1, skip=ONLY_INDEX).failed
        refused = [r for r in caplog.records if "refused" in r.getMessage()]
        assert [r.levelno for r in refused] == [logging.WARNING] + [logging.DEBUG] * 4, refused
        assert "budget" in refused[0].getMessage()

        caplog.clear()
        store.set_limits(0, {CacheForm.INDEXER: one})  # now the form's quota refuses it: another reason
        assert m.persist_batch(1, skip=ONLY_INDEX).failed
        assert [r.levelno for r in caplog.records if "refused" in r.getMessage()] == [logging.WARNING]

        caplog.clear()
        store.set_limits(0, {})  # room again: the form goes in
        assert m.persist_batch(1, skip=ONLY_INDEX).stored == 1
        again = [r for r in caplog.records if "goes in again" in r.getMessage()]
        assert len(again) == 1 and again[0].levelno == logging.INFO
        assert "0 more batches refused since)" in again[0].getMessage()
