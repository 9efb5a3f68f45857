"""Read your writes: pages a set call reported stored are visible to exists and get at once, from the writer's
queue while the disk has not got them yet, bitwise; pages the store then refuses stop being visible.

The disk is held back by an event the test sets (the writer's `store_many` waits on it), so every
assertion before the set of that event runs while the pages are still queued, whatever the machine's speed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvtier.core.forms import Reason
from kvtier.store import StoreFull
from support.daemon import DaemonProc
from support.sglang_pools import (  # first: it skips this module unless SGLang imports
    DSV4_POOLS,
    Dsv4Host,
    PoolName,
    PoolTransfer,
    backup,
    chain,
    kvtier_backend,
    launched_dsv4,
    load,
    page_indices,
    query,
)

PAGES = 4
SLOTS = list(range(PAGES))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return launched_dsv4(tmp_path / "model")


class HeldDisk:
    """The backend's store, its writes held until `release()`; then each batch is stored, or refused as a full
    disk would refuse it (`refuse=True`)."""

    def __init__(self, backend, refuse: bool = False) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.refuse = refuse
        self.store = backend._store
        self._real = self.store.store_many
        self.store.store_many = self._store_many

    def _store_many(self, items) -> None:
        self.entered.set()
        assert self.gate.wait(60), "the test never released the disk"
        if self.refuse:
            raise StoreFull("the disk is full (held disk)", limit="disk")
        self._real(items)

    def release(self) -> None:
        self.gate.set()

    def on_disk(self, backend, keys: list[str]) -> int:
        """How many of the pages' records the store itself holds, over every pool (queue not consulted)."""
        asks = [(backend.object_key(k, g.name), backend._pool(g.name).digest) for k in keys for g in DSV4_POOLS]
        reasons = self.store.has([a for a, _ in asks], [d for _, d in asks])
        return sum(r is Reason.OK for r in reasons)


def _rows(policy) -> list[int]:
    return SLOTS if policy.value == "all_pages" else SLOTS[-1:]


def _assert_reads_own_writes(kv, host: Dsv4Host, disk: HeldDisk, keys: list[str], written) -> None:
    stored = backup(kv, host, keys, SLOTS, state_at={PAGES - 1})
    assert all(all(v) for v in stored.values())
    assert disk.entered.wait(30)  # the writer holds the first batch: nothing of it is on disk
    assert disk.on_disk(kv, keys) == 0
    assert query(kv, keys) == (PAGES, [PAGES])
    assert kv.exists(keys[0])
    host.clear()
    loaded = load(kv, host, keys, SLOTS)
    assert all(all(v) for v in loaded.values()), loaded
    for g in DSV4_POOLS:
        rows = _rows(g.policy)
        assert torch.equal(host.pools[g.name].kv_buffer[rows], written[g.name][rows]), g.name
    assert disk.on_disk(kv, keys) == 0  # still served from the queue, not the disk


def test_pages_just_set_are_visible_before_the_disk_has_them(tmp_path: Path, model: Path) -> None:
    host = Dsv4Host(PAGES)
    host.fill(seed=11)
    written = host.snapshot()
    kv = kvtier_backend(host, model, store_dir=str(tmp_path / "store"))
    disk = HeldDisk(kv)
    keys = chain("ryw", PAGES)
    try:
        _assert_reads_own_writes(kv, host, disk, keys, written)
        disk.release()
        assert kv.flush(30)
        assert disk.on_disk(kv, keys) > 0  # now from the disk, the same answer
        assert query(kv, keys) == (PAGES, [PAGES])
        host.clear()
        assert all(all(v) for v in load(kv, host, keys, SLOTS).values())
        for g in DSV4_POOLS:
            assert torch.equal(host.pools[g.name].kv_buffer[_rows(g.policy)], written[g.name][_rows(g.policy)])
    finally:
        disk.release()
        kv.close()


def test_pages_the_disk_refuses_stop_being_visible(tmp_path: Path, model: Path) -> None:
    host = Dsv4Host(PAGES)
    host.fill(seed=12)
    written = host.snapshot()
    kv = kvtier_backend(host, model, store_dir=str(tmp_path / "store"))
    disk = HeldDisk(kv, refuse=True)
    keys = chain("full", PAGES)
    try:
        _assert_reads_own_writes(kv, host, disk, keys, written)
        disk.release()  # every queued batch now fails as a full disk fails it
        assert kv.flush(30)
        assert kv._writer.failed > 0
        assert query(kv, keys) == (0, [])
        assert not kv.exists(keys[0])
        host.clear()
        loaded = load(kv, host, keys, SLOTS)
        assert not any(any(v) for v in loaded.values()), loaded
        for pool in host.pools.values():
            assert bool((pool.kv_buffer == 0xA5).all())  # no stale bytes reached a host pool
    finally:
        disk.release()
        kv.close()


def test_a_refused_set_is_not_visible(tmp_path: Path, model: Path) -> None:
    """The queue is full: the set call says False, and the page is not reported present while the queue waits."""
    host = Dsv4Host(PAGES)
    host.fill(seed=13)
    kv = kvtier_backend(host, model, store_dir=str(tmp_path / "store"), max_pending_store_bytes=1, store_timeout_s=0.1)
    disk = HeldDisk(kv)
    keys = chain("refused", PAGES)
    c4 = PoolName.DEEPSEEK_V4_C4
    try:
        first = PoolTransfer(name=c4, host_indices=page_indices([0]), keys=keys[:1])
        assert kv.batch_set_v2([first])[c4] == [True]
        assert disk.entered.wait(30)
        second = PoolTransfer(name=c4, host_indices=page_indices([1]), keys=keys[1:2])
        assert kv.batch_set_v2([second])[c4] == [False]
        got = kv.batch_get_v2([PoolTransfer(name=c4, host_indices=page_indices([2, 3]), keys=keys[:2])])[c4]
        assert got == [True, False]
        assert torch.equal(host.pools[c4].kv_buffer[2], host.pools[c4].kv_buffer[0])  # page 0's bytes, from the queue
    finally:
        disk.release()
        assert kv.flush(30)
        kv.close()


def test_through_a_real_daemon_before_the_disk_has_them(tmp_path: Path, model: Path) -> None:
    """Through an engine-only daemon (`profiles = []`: no kvtier pools), as an SGLang-only node runs it."""
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProc(tmp_path / "daemon", store_root=tmp_path / "store", profiles=())
    try:
        host = Dsv4Host(PAGES)
        host.fill(seed=14)
        written = host.snapshot()
        kv = kvtier_backend(host, model, daemon_socket=str(daemon.socket))
        disk = HeldDisk(kv)
        keys = chain("daemon", PAGES)
        try:
            _assert_reads_own_writes(kv, host, disk, keys, written)
        finally:
            disk.release()
        assert kv.flush(30)
        assert disk.on_disk(kv, keys) > 0 and query(kv, keys) == (PAGES, [PAGES])
        kv.close()
        assert daemon.proc.poll() is None and "Traceback" not in daemon.read_log()
        from kvtier.wire import Connection

        with Connection(daemon.socket, name="test") as conn:
            doc = conn.stats()
        assert doc.daemon is not None and doc.daemon.pools == "none" and doc.profiles == []
    finally:
        assert daemon.terminate() == 0
