"""What a key reads as under random stores, evictions, removals, quarantines and prunes (hypothesis state
machine on a real store): OK while live, `evicted` while a tombstone remembers it, `missing` otherwise, and
the record and tombstone counts always match the model."""

from __future__ import annotations

import shutil
import tempfile
import time

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, QuarantineReason, StoreConfig
from support.store_helpers import DIGEST, VK, make_key, make_payload

TAGS = [f"k{i}" for i in range(5)]
SIZE = 5000
keys_ = st.sampled_from(TAGS)


class TombstoneMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvtier-tomb-")
        self.store = DiskStore(self.root, StoreConfig(io_threads=1), writer=True)
        self.ns = self.store.register_namespace(VK)
        self.model: dict[str, Reason] = {t: Reason.MISSING for t in TAGS}  # what each key should read as
        self.evicted_at: dict[str, float] = {}

    def key(self, tag: str):
        return make_key(self.ns, tag)

    @rule(tag=keys_)
    def store_it(self, tag: str) -> None:
        self.store.store(self.key(tag), make_payload(tag, SIZE), DIGEST)
        if self.model[tag] is not Reason.OK:  # a live key is a no-op; anything else gets a fresh record
            self.model[tag] = Reason.OK
            self.evicted_at.pop(tag, None)

    @rule(tag=keys_)
    def evict(self, tag: str) -> None:
        live = self.model[tag] in (Reason.OK, Reason.CORRUPT)
        assert self.store.evict([self.key(tag)]) == int(live)
        if live:
            self.model[tag] = Reason.EVICTED
            self.evicted_at[tag] = time.time()

    @rule(tag=keys_)
    def remove(self, tag: str) -> None:
        indexed = self.model[tag] in (Reason.OK, Reason.CORRUPT)
        assert self.store.remove([self.key(tag)]) == int(indexed)
        if indexed:  # an old tombstone cannot outlive a newer record, so removal leaves a plain miss
            self.model[tag] = Reason.MISSING

    @rule(tag=keys_)
    def quarantine(self, tag: str) -> None:
        indexed = self.model[tag] in (Reason.OK, Reason.CORRUPT)
        assert self.store.quarantine(self.key(tag), QuarantineReason.PAYLOAD) is indexed
        if indexed:
            self.model[tag] = Reason.CORRUPT

    @precondition(lambda self: self.evicted_at)
    @rule(scan=st.integers(1, 6))
    def prune_all(self, scan: int) -> None:
        """Everything evicted so far is older than `cutoff`; bounded scans resume until the end."""
        cutoff, start, pruned = time.time() + 1.0, b"", 0
        while True:
            n, start = self.store.prune_tombstones(cutoff, start=start, scan=scan)
            pruned += n
            if not start:
                break
        assert pruned == sum(r is Reason.EVICTED for r in self.model.values())
        for tag in list(self.evicted_at):
            self.model[tag] = Reason.MISSING
        self.evicted_at.clear()

    @rule()
    def prune_nothing_recent(self) -> None:
        assert self.store.prune_tombstones(min(self.evicted_at.values(), default=time.time()) - 60.0) == (0, b"")

    @invariant()
    def reads_as_modelled(self) -> None:
        keys = [self.key(t) for t in TAGS]
        assert self.store.has(keys, [DIGEST] * len(TAGS)) == [self.model[t] for t in TAGS]
        outs = [torch.zeros(SIZE, dtype=torch.uint8) for _ in TAGS]
        loads = self.store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
        assert loads == [self.model[t] for t in TAGS]
        for tag, out, got in zip(TAGS, outs, loads):
            assert torch.equal(out, make_payload(tag, SIZE)) if got is Reason.OK else not out.any()
        stats = self.store.stats()
        assert stats["records"] == sum(r in (Reason.OK, Reason.CORRUPT) for r in self.model.values())
        assert stats["evicted_tombstones"] == sum(r is Reason.EVICTED for r in self.model.values())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


TestTombstones = TombstoneMachine.TestCase
TestTombstones.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
