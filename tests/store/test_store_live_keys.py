"""`DiskStore.live_keys`: the pages of a namespace's live keys are exactly the keys `has` answers OK for, whatever
the page size, in one namespace only; its snapshot id moves with every commit and only then."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core import CacheForm, Reason, VersionKey
from kvtier.store import DiskStore, QuarantineReason, StoreConfig, StoreRequestError
from support.store_helpers import DIGEST, VK, make_key, make_payload

GROUPS = (("c4", CacheForm.COMPRESSED), ("idx", CacheForm.INDEXER), ("swa", CacheForm.SWA))


def all_pages(store: DiskStore, ns: bytes, limit: int) -> list[tuple[bytes, str]]:
    keys, after = [], b""
    while True:
        page = store.live_keys(ns, after, limit)
        keys += page.keys
        if not page.cursor:
            return keys
        after = page.cursor


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """40 keys over three groups in one namespace (some quarantined, some evicted) and 10 in another."""
    store = DiskStore(str(tmp_path_factory.mktemp("live")), StoreConfig(io_threads=1), writer=True)
    ns = store.register_namespace(VK)
    other = store.register_namespace(VersionKey("other", "w", "a", "c", "i", "l"))
    keys = [make_key(ns, f"k{i}", *GROUPS[i % 3]) for i in range(40)]
    store.store_many([(k, make_payload(k.group, 64), DIGEST) for k in keys])
    store.store_many([(make_key(other, f"o{i}"), make_payload("o", 64), DIGEST) for i in range(10)])
    for k in keys[::7]:
        assert store.quarantine(k, QuarantineReason.PAYLOAD)
    assert store.evict(keys[1::9]) == len(keys[1::9])
    yield store, ns, keys
    store.close()


@settings(max_examples=25, deadline=None)
@given(limit=st.integers(1, 45))
def test_pages_hold_exactly_the_keys_has_answers_ok(populated, limit: int) -> None:
    store, ns, keys = populated
    ok = {(k.block_hash, k.group) for k, r in zip(keys, store.has(keys, [DIGEST] * len(keys))) if r is Reason.OK}
    assert 0 < len(ok) < len(keys)  # some quarantined and evicted, the rest live
    paged = all_pages(store, ns, limit)
    assert len(paged) == len(set(paged)) and set(paged) == ok


def test_the_snapshot_id_moves_with_a_commit_and_only_then(tmp_path) -> None:
    with DiskStore(str(tmp_path), StoreConfig(io_threads=1), writer=True) as store:
        ns = store.register_namespace(VK)
        before = store.live_keys(ns, limit=0)
        assert before.keys == [] and before.cursor == b""
        assert store.live_keys(ns).txn == before.txn
        store.store(make_key(ns, "new"), make_payload("new", 64), DIGEST)
        after = store.live_keys(ns)
        assert after.txn > before.txn and after.keys == [(make_key(ns, "new").block_hash, "c4")]


def test_a_cursor_of_another_namespace_is_refused(populated) -> None:
    store, ns, _ = populated
    with pytest.raises(StoreRequestError, match="cursor of this namespace"):
        store.live_keys(ns, b"\xff" * 40)
    with pytest.raises(StoreRequestError):
        store.live_keys(ns, limit=-1)
