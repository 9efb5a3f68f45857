"""A store that may load maps its index's pages into the process when it opens (`index_map.map_in`); one that only
reads (the CLI's), the verifier's and a daemon's before `take_load_resources` leave them to fault in on use."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from kvtier.store import DiskStore
from kvtier.store.index_map import map_in
from support.store_helpers import DIGEST, VK, make_key

RECORDS = 6_000  # an index of a few hundred pages: far more than a lookup's fault maps around it

pytestmark = pytest.mark.skipif(
    tuple(int(x) for x in platform.release().split(".")[:2]) < (5, 14), reason="MADV_POPULATE_READ is Linux 5.14+"
)


@pytest.fixture
def store_root(tmp_path) -> str:
    root = str(tmp_path / "store")
    payload = torch.zeros(64, dtype=torch.uint8)
    with DiskStore(root, writer=True, take_load_resources=False) as s:
        s.register_namespace(VK)
        keys = [make_key(VK.namespace, f"m{i}") for i in range(RECORDS)]
        for lo in range(0, RECORDS, 1_000):
            s.store_many([(k, payload, DIGEST) for k in keys[lo : lo + 1_000]])
    return root


def _mapped(store: DiskStore) -> tuple[int, int]:
    """Bytes of the index's data file mapped into this process (smaps Rss), and the bytes its pages use."""
    data = os.path.realpath(os.path.join(store.index.path, "data.mdb"))
    rss, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split(maxsplit=5)
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                inside = len(fields) == 6 and fields[5].rstrip("\n") == data
            elif inside and fields[0] == "Rss:":
                rss = int(fields[1]) * 1024
                break
    assert rss is not None, "the index is not mapped"
    env = store.index.env
    return rss, (env.info()["last_pgno"] + 1) * env.stat()["psize"]


def test_a_store_that_may_load_maps_its_index_in_at_open(store_root) -> None:
    for opened in ({"writer": True}, {}):
        with DiskStore(store_root, **opened) as s:
            rss, used = _mapped(s)
            assert used > 100 * 4096
            assert rss >= used - 4096, opened  # (the file may hold a free page past the last one used)


def test_stores_that_do_not_load_leave_their_index_to_fault_in(store_root) -> None:
    with DiskStore(store_root, readonly=True) as s:
        rss, used = _mapped(s)
        assert rss < used // 4
    with DiskStore(store_root, writer=True, take_load_resources=False) as s:
        rss, used = _mapped(s)
        assert rss < used // 4
        s.take_load_resources()  # (a daemon, once torch has loaded)
        rss, used = _mapped(s)
        assert rss >= used - 4096


def test_map_in_goes_in_pieces_up_to_the_prefetch_limit(store_root, monkeypatch) -> None:
    import kvtier.store.index_map as index_map

    monkeypatch.setattr(index_map, "PIECE_BYTES", 3 * 4096)  # (pieces that do not divide the limit)
    with DiskStore(store_root, readonly=True) as s:
        monkeypatch.setattr(index_map, "PREFETCH_INDEX_BYTES", 16 * 4096)
        assert map_in(s.index) == 16 * 4096
        assert _mapped(s)[0] < _mapped(s)[1] // 4
        monkeypatch.setattr(index_map, "PREFETCH_INDEX_BYTES", 1 << 30)
        assert map_in(s.index) >= _mapped(s)[1] - 4096
        rss, used = _mapped(s)
        assert rss >= used - 4096
