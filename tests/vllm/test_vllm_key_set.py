"""The vLLM tier's in-memory key set over a real store (no vLLM needed): it holds exactly the namespace's live
keys after a pass, keeps this tier's own commits across a pass, and a pass that fails part-way leaves the set
as it was (stale answers are safe; an emptied set would turn every hit into a recompute)."""

from __future__ import annotations

import pytest

from kvtier.core.errors import KvtierError
from kvtier.integrations.key_set import KeySet
from kvtier.store import DiskStore, StoreConfig
from support.store_helpers import DIGEST, VK, make_key, make_payload

N = 5000  # more than two pages


@pytest.fixture
def store(tmp_path):
    with DiskStore(str(tmp_path), StoreConfig(io_threads=1), writer=True) as s:
        yield s


def test_a_pass_holds_the_live_keys_and_a_failed_pass_changes_nothing(store: DiskStore) -> None:
    ns = store.register_namespace(VK)
    keys = [make_key(ns, f"k{i}") for i in range(N)]
    store.store_many([(k, make_payload("p", 16), DIGEST) for k in keys])
    assert store.evict(keys[:10]) == 10
    pages = []

    def read(after: bytes, limit: int):
        pages.append(after)
        if len(pages) == 2 and mode == "fail":  # the store stops answering in the middle of a pass
            raise KvtierError("gone")
        if len(pages) == 2 and mode == "commit":  # this tier commits a key while the pass runs
            ks.add([(7, keys[0].block_hash)])
        return store.live_keys(ns, after, limit)

    mode = ""
    ks = KeySet(read, {"c4": 7}, refresh_s=3600.0)
    try:
        assert len(ks) == N - 10 and not ks.has(7, keys[0].block_hash) and ks.has(7, keys[-1].block_hash)
        mode, pages[:] = "fail", []
        store.evict(keys[10:20])
        with pytest.raises(KvtierError):
            ks._pass()
        assert len(ks) == N - 10  # the half-read pass replaced nothing
        mode, pages[:] = "commit", []
        ks._pass()
        assert len(ks) == N - 20 + 1 and ks.has(7, keys[0].block_hash)  # kept across the pass's swap
        mode = ""
        ks._pass()  # the store does not hold it (stale, and safe: its load would fail): the next pass drops it
        assert len(ks) == N - 20 and not ks.has(7, keys[0].block_hash)
    finally:
        ks.close()
