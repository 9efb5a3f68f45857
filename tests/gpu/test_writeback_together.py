"""A write-back round stores every form's batch in one batch of the store: one sync and one commit, which a durable
offload waits for, not one per form. Where the store refuses that batch (all or nothing), each form's batch is
stored alone, so a form over its quota holds back no other."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.forms import CacheForm, Reason
from kvtier.gpu import CacheManager
from kvtier.store import DiskStore, StoreConfig
from kvtier.store.record import record_length
from support.gpuworld import PROFILE, budgets, hashes_of, key, payload, prompt, write


def _store_calls(store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> list[set[CacheForm]]:
    """The forms of each `store_many` call that reached the store (refused ones included)."""
    calls: list[set[CacheForm]] = []
    real = store.store_many

    def store_many(items):  # type: ignore[no-untyped-def]
        calls.append({k.form for k, _, _ in items})
        return real(items)

    monkeypatch.setattr(store, "store_many", store_many)
    return calls


@contextlib.contextmanager
def _node(tmp_path: Path, config: StoreConfig) -> Iterator[tuple[DiskStore, CacheManager]]:
    """A store with the profile's namespace and a manager writing back to it."""
    with DiskStore(str(tmp_path), config, writer=True) as store:
        store.register_namespace(PROFILE.version)
        m = CacheManager(PROFILE, budgets_bytes=budgets(PROFILE, 8), lower=store)
        try:
            yield store, m
        finally:
            m.close()


def _written(m: CacheManager) -> list:
    hashes = hashes_of(m, prompt(3, 2))
    assert write(m, hashes, range(2), state_at={1}) > 0
    return [key(m, hashes[b], g.name) for b in range(2) for g in PROFILE.groups if b == 1 or g.kind.value == "history"]


def _payloads(m: CacheManager, keys: list) -> list:
    return [(k, payload(PROFILE, k.group, k.block_hash, m.namespace)) for k in keys]


def test_every_forms_batch_goes_to_the_store_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _node(tmp_path, StoreConfig(io_backend="buffered")) as (store, m):
        keys = _written(m)
        calls = _store_calls(store, monkeypatch)
        outcome = m.persist_batch(only=keys)
        assert outcome.stored == len(keys) and not outcome.failed
        assert calls == [{g.form for g in PROFILE.groups}]  # all four forms, one durable batch
        digests = [m.layout_digest(k.group) for k in keys]
        assert store.has(keys, digests) == [Reason.OK] * len(keys)


def test_a_form_over_its_quota_is_refused_alone_and_the_others_go_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = StoreConfig(io_backend="buffered", form_quotas={CacheForm.SWA: 4096})  # no SWA record fits
    with _node(tmp_path, config) as (store, m):
        keys = _written(m)
        calls = _store_calls(store, monkeypatch)
        outcome = m.persist_batch(only=keys)
        swa = [k for k in keys if k.form is CacheForm.SWA]
        assert set(outcome.failed) == {CacheForm.SWA} and "quota" in outcome.failed[CacheForm.SWA]
        assert outcome.refused_objects == {CacheForm.SWA: len(swa)}
        assert outcome.stored == len(keys) - len(swa)
        assert len(calls[0]) == 4 and sorted(map(len, calls[1:])) == [1, 1, 1, 1]  # together, then each alone
        digests = [m.layout_digest(k.group) for k in keys]
        assert store.has(keys, digests) == [Reason.MISSING if k.form is CacheForm.SWA else Reason.OK for k in keys]


def test_a_call_told_to_end_leaves_the_forms_not_yet_tried_sealed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each form stored alone is a sync and a commit of its own, which a durable offload that waits for the write-back
    waits for too: `until` ends the round between two of them, and the forms not tried wait for the next call."""
    config = StoreConfig(io_backend="buffered", form_quotas={CacheForm.SWA: 4096})  # the forms go in one by one
    with _node(tmp_path, config) as (store, m):
        keys = _written(m)
        calls = _store_calls(store, monkeypatch)
        outcome = m.persist_batch(only=keys, until=lambda: True)
        assert len(calls[0]) == 4 and len(calls) == 2  # together, then one form alone, then no more
        (tried,) = calls[1]
        assert outcome.stored == (0 if tried is CacheForm.SWA else sum(k.form is tried for k in keys))
        waiting = m.write_back_backlog()
        assert all(waiting.get(k.form, 0) > 0 for k in keys if k.form is not tried)  # untried: sealed, not refused
        assert set(outcome.failed) <= {tried}
        rest = m.persist_batch(only=keys)
        assert outcome.stored + rest.stored == sum(k.form is not CacheForm.SWA for k in keys)


def test_a_call_told_to_end_stores_one_round(tmp_path: Path) -> None:
    """A round pins at most a share of each pool; a call takes rounds until done, or until `until` says to end."""
    with _node(tmp_path, StoreConfig(io_backend="buffered")) as (_, m):
        hashes = hashes_of(m, prompt(5, 8))
        written = write(m, hashes, range(8), state_at={7})
        first = m.persist_batch(until=lambda: True)
        assert 0 < first.stored < written and not first.failed
        assert m.persist_batch().stored == written - first.stored  # the rest, in as many rounds as it takes


def test_a_budget_with_some_room_takes_what_fits_in_one_more_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget is shared by every form: refused together, each form alone would be refused the same way or take
    the room a batch at a time, each a sync and a commit (a durable offload's objects went in over six of them
    on a store the cleaner was making room in). One batch of what the room takes instead, the forms in turn."""
    probe = StoreConfig(io_backend="buffered")
    with _node(tmp_path / "probe", probe) as (_, m):
        sizes = {k: record_length(v.numel()) for k, v in _payloads(m, _written(m))}
    budget = sum(sizes.values()) - max(sizes.values())  # room for all but one object's bytes
    with _node(tmp_path / "room", StoreConfig(io_backend="buffered", budget_bytes=budget)) as (store, m):
        keys = _written(m)
        calls = _store_calls(store, monkeypatch)
        outcome = m.persist_batch(only=keys)
        assert len(calls) == 2 and len(calls[0]) == 4  # together (refused), then what fits: no form alone
        assert len(calls[1]) > 1  # the forms took turns
        assert 0 < outcome.stored < len(keys)
        assert all("budget" in why for why in outcome.failed.values())
        assert sum(outcome.refused_objects.values()) == len(keys) - outcome.stored
        digests = [m.layout_digest(k.group) for k in keys]
        refused = [sizes[k] for k, r in zip(keys, store.has(keys, digests)) if r is not Reason.OK]
        used = store.stats()["record_bytes"]
        assert used <= budget and budget - used < min(refused)  # the room is taken: no refused object would fit
