"""kvtier as SGLang's HiCache storage, driven through SGLang's real classes with DSV4's six host pools.

Every comparison with HiCacheFile writes the same pages through both backends and asks both the same
question, the way SGLang's cache controller asks it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.store import DiskStore
from support.corrupt import flip_payload_bit
from support.daemon import DaemonProc
from support.sglang_pools import (  # first: it skips this module unless SGLang imports
    DSV4_POOLS,
    PAGE,
    Dsv4Host,
    FakePagedPool,
    HiCacheStorageExtraInfo,
    KvtierHiCacheStorage,
    PoolName,
    PoolTransfer,
    backup,
    chain,
    file_backend,
    kvtier_backend,
    launch,
    launched_dsv4,
    load,
    page_indices,
    query,
    write_checkpoint,
)

PAGES = 4
SLOTS = list(range(PAGES))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return launched_dsv4(tmp_path / "model")


def flip_record(store_dir: Path, key) -> None:
    """Flip one payload bit of `key`'s record in its segment file (the backend is closed)."""
    with DiskStore(str(store_dir), readonly=True) as store:
        (info,) = store.records([key])
    flip_payload_bit(store_dir, info.entry, info.entry.payload_len // 2, 3)


def test_dynamic_backend_round_trips_every_pool_byte_exact(tmp_path: Path, model: Path) -> None:
    host = Dsv4Host(PAGES)
    host.fill(seed=1)
    written = host.snapshot()
    backend = kvtier_backend(host, model, store_dir=str(tmp_path / "store"))
    assert isinstance(backend, KvtierHiCacheStorage)
    keys = chain("a", PAGES)
    stored = backup(backend, host, keys, SLOTS, state_at={PAGES - 1})
    assert all(all(v) for v in stored.values()) and len(stored) == 6
    assert backend.flush(30)

    host.clear()
    pages, restorable = query(backend, keys)
    assert pages == PAGES and restorable == [PAGES]  # state was written only at the node's end
    loaded = load(backend, host, keys, SLOTS)
    assert all(all(v) for v in loaded.values())
    for g in DSV4_POOLS:
        got, want = host.pools[g.name].kv_buffer, written[g.name]
        rows = SLOTS if g.policy.value == "all_pages" else SLOTS[-1:]
        assert torch.equal(got[rows], want[rows]), g.name
    backend.close()

    # A restart reads the same records under the same namespace.
    again = kvtier_backend(Dsv4Host(PAGES), model, store_dir=str(tmp_path / "store"))
    assert query(again, keys)[0] == PAGES
    again.close()


def test_shared_prefix_hits_like_hicache_file(tmp_path: Path, model: Path) -> None:
    host = Dsv4Host(PAGES)
    host.fill(seed=2)
    kv = kvtier_backend(host, model, store_dir=str(tmp_path / "store"))
    hf = file_backend(host, tmp_path / "hicache")
    keys = chain("a", PAGES)
    for backend in (kv, hf):  # state written at the checkpoints after pages 2 and 4
        backup(backend, host, keys, SLOTS, state_at={1, 3})
    assert kv.flush(30)
    other = keys[:3] + chain("b", 1, parent=keys[2])  # shares 3 pages, then differs
    for asked, want in ((keys, 4), (other, 2), (keys[:3], 2), (keys[:1], 0)):
        assert query(kv, asked)[0] == query(hf, asked)[0] == want
    kv.close()


def test_incomplete_state_window_is_no_hit_where_hicache_file_serves_it(tmp_path: Path, model: Path) -> None:
    """A 2-page state window at a boundary one page into the span: its first page lies in the prefix.

    HiCacheFile checks only the window's pages inside the span; kvtier checks the whole window over
    prefix_keys + keys, so a window whose prefix page was never stored is no hit.
    """
    host = Dsv4Host(PAGES)
    host.fill(seed=3)
    kv = kvtier_backend(host, model, store_dir=str(tmp_path / "store"))
    hf = file_backend(host, tmp_path / "hicache")
    keys = chain("a", 3)
    for backend in (kv, hf):
        backup(backend, host, keys, SLOTS[:3], state_at={1})  # state of page 1 only
    assert kv.flush(30)
    prefix, span = keys[:1], keys[1:2]  # page 0 is in SGLang's prefix; the span is page 1
    assert query(hf, span, prefix, window_pages=2)[0] == 1  # window [page 0, page 1]: page 0's state missing
    assert query(kv, span, prefix, window_pages=2)[0] == 0
    # With the window's prefix page stored too, kvtier serves the same boundary.
    for backend in (kv, hf):
        backup(backend, host, keys[:1], SLOTS[:1], state_at={0})
    assert kv.flush(30)
    assert query(kv, span, prefix, window_pages=2) == (1, [1])
    kv.close()


def test_flipped_byte_is_fewer_pages_never_wrong_bytes(tmp_path: Path, model: Path) -> None:
    host = Dsv4Host(PAGES)
    host.fill(seed=4)
    written = host.snapshot()
    store_dir, file_dir = tmp_path / "store", tmp_path / "hicache"
    kv = kvtier_backend(host, model, store_dir=str(store_dir))
    hf = file_backend(host, file_dir)
    keys = chain("a", PAGES)
    for backend in (kv, hf):
        backup(backend, host, keys, SLOTS, state_at={PAGES - 1})
    assert kv.flush(30)
    c4 = PoolName.DEEPSEEK_V4_C4
    victim = kv.object_key(keys[2], c4)
    kv.close()
    flip_record(store_dir, victim)
    hf_file = file_dir / f"{keys[2]}.{c4.value}{hf.config_suffix}.bin"
    raw = bytearray(hf_file.read_bytes())
    raw[len(raw) // 2] ^= 0x08
    hf_file.write_bytes(raw)

    host.clear()
    kv = kvtier_backend(host, model, store_dir=str(store_dir))
    got = load(kv, host, keys, SLOTS)
    assert got[c4] == [True, True, False, True]
    pool = host.pools[c4].kv_buffer
    assert torch.equal(pool[[0, 1, 3]], written[c4][[0, 1, 3]])
    assert bool((pool[2] == 0xA5).all())  # the corrupt page never reached the host pool
    # Quarantined: C4 now ends at page 2, where no state was written, so no length is restorable at all.
    assert query(kv, keys) == (0, [])
    kv.close()

    host.clear()
    got = load(hf, host, keys, SLOTS)
    assert got[c4] == [True] * PAGES  # HiCacheFile reports success ...
    assert not torch.equal(host.pools[c4].kv_buffer[2], written[c4][2])  # ... with the flipped byte in the pool


def test_changed_compressor_config_is_a_new_namespace(tmp_path: Path, model: Path) -> None:
    host = Dsv4Host(PAGES)
    host.fill(seed=5)
    kv = kvtier_backend(host, model, store_dir=str(tmp_path / "store"))
    keys = chain("a", PAGES)
    backup(kv, host, keys, SLOTS, state_at={PAGES - 1})
    assert kv.flush(30)
    assert query(kv, keys)[0] == PAGES
    kv.close()
    for change in ({"compress_ratios": [0, 0, 4, 4, 4, 128, 4, 0]}, {"index_topk": 1024}):
        other = write_checkpoint(tmp_path / f"model-{next(iter(change))}", **change)
        launch(other)
        kv = kvtier_backend(Dsv4Host(PAGES), other, store_dir=str(tmp_path / "store"))
        assert query(kv, keys) == (0, [])
        kv.close()


def test_v1_interface_for_a_plain_kv_pool(tmp_path: Path, model: Path) -> None:
    """A non-hybrid model: one KV pool with real bytes, through batch_set_v1 / batch_get_v1 / batch_exists."""
    pool = FakePagedPool(item_bytes=2 * 128 * 2, layer_num=4, num_pages=PAGES, page_size=64)
    pool.kv_buffer.copy_(torch.randint(0, 256, pool.kv_buffer.shape, dtype=torch.uint8))
    written = pool.kv_buffer.clone()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from support.sglang_pools import storage_config

    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "model_dir": str(model),
        "store_dir": str(tmp_path / "store"),
    }
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    keys = chain("v1", PAGES)
    indices = torch.arange(PAGES * 64, dtype=torch.int64)
    extra_info = HiCacheStorageExtraInfo(prefix_keys=None)
    assert backend.batch_set_v1(keys, indices, extra_info) == [True] * PAGES
    assert backend.flush(30)
    assert backend.batch_exists(keys, extra_info) == PAGES and backend.exists(keys[0])
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, indices, extra_info) == [True] * PAGES
    assert torch.equal(pool.kv_buffer, written)
    assert backend.batch_get_v1(chain("other", 1), indices[:64], extra_info) == [False]
    backend.close()


def test_stores_never_block_beyond_the_bound(tmp_path: Path, model: Path) -> None:
    """With the writer's queue full, a set call returns (refused) within store_timeout_s."""
    import threading
    import time

    host = Dsv4Host(PAGES)
    kv = kvtier_backend(host, model, store_dir=str(tmp_path / "store"), max_pending_store_bytes=1, store_timeout_s=0.2)
    gate = threading.Event()
    real = kv._store.store_many
    kv._store.store_many = lambda items: (gate.wait(30), real(items))  # a disk that stalls
    keys = chain("a", PAGES)
    c4 = PoolName.DEEPSEEK_V4_C4
    first = PoolTransfer(name=c4, host_indices=page_indices([0]), keys=keys[:1])
    assert kv.batch_set_v2([first])[c4] == [True]  # queued; the writer now stalls on it
    started = time.monotonic()
    second = PoolTransfer(name=c4, host_indices=page_indices([1]), keys=keys[1:2])
    assert kv.batch_set_v2([second])[c4] == [False]
    assert time.monotonic() - started < 5
    gate.set()
    assert kv.flush(30)
    kv.close()


def test_through_a_real_daemon(tmp_path: Path, model: Path) -> None:
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProc(tmp_path / "daemon", store_root=tmp_path / "store")
    try:
        host = Dsv4Host(PAGES)
        host.fill(seed=6)
        written = host.snapshot()
        kv = kvtier_backend(host, model, daemon_socket=str(daemon.socket))
        keys = chain("a", PAGES)
        backup(kv, host, keys, SLOTS, state_at={PAGES - 1})
        assert kv.flush(30)
        host.clear()
        assert query(kv, keys) == (PAGES, [PAGES])
        loaded = load(kv, host, keys, SLOTS)
        assert all(all(v) for v in loaded.values())
        for g in DSV4_POOLS:
            rows = SLOTS if g.policy.value == "all_pages" else SLOTS[-1:]
            assert torch.equal(host.pools[g.name].kv_buffer[rows], written[g.name][rows]), g.name
        kv.close()
        assert daemon.proc.poll() is None and "Traceback" not in daemon.read_log()
    finally:
        assert daemon.terminate() == 0


def test_page_size_of_every_pool_is_dsv4s() -> None:
    host = Dsv4Host(1)
    assert {p.page_size for p in host.pools.values()} == {PAGE} and host.anchor.page_size == PAGE
    assert len(host.pools) == 6
