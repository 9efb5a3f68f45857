"""The SGLang backend's BoundedWriter (plain Python, no SGLang needed): what it answers for queued pages.

The store it writes to is a real DiskStore; its `store_many` is held on an event the test sets, so every
assertion about "queued, not yet on disk" runs while the batch really is in the writer's hands.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.integrations.sglang.writer import BoundedWriter
from kvtier.store import DiskStore, StoreFull

VK = VersionKey("writer-test", "xxh3_128:test", "abi", "-", "-", "uint8")
NS = VK.namespace
DIGEST, OTHER_DIGEST = b"d" * 16, b"e" * 16


def key(i: int) -> ObjectKey:
    return ObjectKey(NS, bytes([i]) * 16, "kv", CacheForm.COMPRESSED)


class Held:
    def __init__(self, store: DiskStore, refuse: bool = False) -> None:
        self.store, self.refuse = store, refuse
        self.gate, self.entered = threading.Event(), threading.Event()

    def __call__(self, items) -> None:  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.gate.wait(30)
        if self.refuse:
            raise StoreFull("full (held)", limit="disk")
        self.store.store_many(items)


def test_queued_pages_are_answered_until_stored_then_by_the_store(tmp_path: Path) -> None:
    with DiskStore(str(tmp_path / "s"), writer=True) as store:
        store.register_namespace(VK)
        held = Held(store)
        writer = BoundedWriter(held, 1 << 20, 0.5)
        page = torch.arange(512, dtype=torch.int16).view(torch.uint8)
        try:
            assert writer.submit([(key(1), page, DIGEST)])
            page.zero_()  # the caller's buffer is reused at once (SGLang's host slot): the queue kept a copy
            assert held.entered.wait(30)
            got = writer.queued([key(1), key(2), key(1)], [DIGEST, DIGEST, OTHER_DIGEST])
            assert got[1] is None and got[2] is None  # never queued; queued under another layout
            assert got[0] is not None and torch.equal(got[0], torch.arange(512, dtype=torch.int16).view(torch.uint8))
            assert store.has([key(1)], [DIGEST]) == [Reason.MISSING]  # not on disk yet
        finally:
            held.gate.set()
        assert writer.flush(30)
        assert writer.queued([key(1)], [DIGEST]) == [None]  # on disk now: the store answers
        assert store.has([key(1)], [DIGEST]) == [Reason.OK]
        writer.close()


def test_a_batch_the_store_refuses_is_no_longer_answered(tmp_path: Path) -> None:
    with DiskStore(str(tmp_path / "s"), writer=True) as store:
        store.register_namespace(VK)
        held = Held(store, refuse=True)
        writer = BoundedWriter(held, 1 << 20, 0.5)
        try:
            assert writer.submit([(key(3), torch.ones(64, dtype=torch.uint8), DIGEST)])
            assert held.entered.wait(30)
            assert writer.queued([key(3)], [DIGEST])[0] is not None
        finally:
            held.gate.set()
        assert writer.flush(30)
        assert writer.failed == 1 and writer.queued([key(3)], [DIGEST]) == [None]
        assert store.has([key(3)], [DIGEST]) == [Reason.MISSING]
        writer.close()


def test_a_later_set_of_the_same_key_is_what_is_answered(tmp_path: Path) -> None:
    """Two batches carry one key: the first's completion must not take the second's entry out."""
    with DiskStore(str(tmp_path / "s"), writer=True) as store:
        store.register_namespace(VK)
        held = Held(store)
        writer = BoundedWriter(held, 1 << 20, 0.5)
        try:
            assert writer.submit([(key(4), torch.full((64,), 1, dtype=torch.uint8), DIGEST)])
            assert held.entered.wait(30)  # the first batch is being written
            assert writer.submit([(key(4), torch.full((64,), 2, dtype=torch.uint8), DIGEST)])
            got = writer.queued([key(4)], [DIGEST])[0]
            assert got is not None and int(got[0]) == 2
        finally:
            held.gate.set()
        assert writer.flush(30)
        assert writer.queued([key(4)], [DIGEST]) == [None]
        writer.close()
