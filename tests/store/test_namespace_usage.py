"""Records and bytes per namespace, kept as index rows (`kvtier.store.ns_usage`): the same figures a walk over the
object table gives, after any sequence of writes, drops, evictions, quarantines, moves, reopens and writes by a
kvtier that does not keep the rows; stale rows are never trusted, and the next writer's open counts them again."""

from __future__ import annotations

import tempfile
from unittest import mock

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.store import DiskStore, StoreConfig, ns_usage
from kvtier.store.accounting import Ledger
from kvtier.store.decisions import DropIf
from kvtier.store.errors import QuarantineReason
from kvtier.store.index import encode_key
from support.store_helpers import DIGEST, VK, current, kept, make_key, make_payload, walked

CONFIG = StoreConfig(segment_bytes=128 << 10, io_threads=2)


def no_walk() -> mock._patch:
    """`namespace_usage` may not count the object table (it must read the rows)."""
    return mock.patch.object(ns_usage, "_count", side_effect=AssertionError("walked the object table"))


def a_kvtier_without_the_rows() -> mock._patch:
    """A writer that keeps the form usage and not the namespace rows, as kvtier did before them."""
    return mock.patch.object(Ledger, "_namespace", lambda self, raw_key, records, nbytes: None)


class NamespaceRows(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory(prefix="kvtier-nsrows-")
        self.store = DiskStore(self.dir.name, CONFIG, writer=True)
        self.ns = [self.store.register_namespace(VK.bumped(model_id=f"m{n}")) for n in range(3)]
        self.stale = False  # a writer without the rows has written since the last open

    def _key(self, n: int, i: int):
        return make_key(self.ns[n], f"ns{i}")

    @rule(n=st.integers(0, 2), i=st.integers(0, 9), size=st.sampled_from([1, 4096, 9000, 30_000]))
    def put(self, n: int, i: int, size: int) -> None:
        self.store.store(self._key(n, i), make_payload(f"{n}-{i}-{size}", size), DIGEST)

    @rule(n=st.integers(0, 2), first=st.integers(0, 9), size=st.sampled_from([100, 20_000]))
    def put_many(self, n: int, first: int, size: int) -> None:
        keys = [self._key(n, i) for i in range(first, min(first + 4, 10))]
        self.store.store_many([(k, make_payload(f"{k.block_hash.hex()}-{size}", size), DIGEST) for k in keys])

    @rule(n=st.integers(0, 2), i=st.integers(0, 9))
    def remove(self, n: int, i: int) -> None:
        self.store.remove([self._key(n, i)])

    @rule(n=st.integers(0, 2), i=st.integers(0, 9))
    def evict(self, n: int, i: int) -> None:  # the cleaner's decision, with a tombstone
        self.store.drop_if([DropIf(encode_key(self._key(n, i)))], tombstone=True)

    @rule(n=st.integers(0, 2), i=st.integers(0, 9), size=st.sampled_from([4096, 9000]))
    def quarantine_and_store_again(self, n: int, i: int, size: int) -> None:
        key = self._key(n, i)
        if self.store.quarantine(key, QuarantineReason.PAYLOAD):
            self.store.store(key, make_payload(f"q{n}-{i}-{size}", size), DIGEST)  # replaces the quarantined record

    @rule(n=st.integers(0, 2))
    def relocate(self, n: int) -> None:  # compaction's move
        keys = [r.key for r in self.store.iter_records(namespace=self.ns[n], limit=10)]
        self.store.relocate([keys])

    @rule(n=st.integers(0, 2), i=st.integers(0, 9), drop=st.booleans())
    def an_older_kvtier_writes(self, n: int, i: int, drop: bool) -> None:
        with a_kvtier_without_the_rows():
            if drop:
                if self.store.remove([self._key(n, i)]):
                    self.stale = True
            else:
                self.store.store(self._key(n, i), make_payload(f"old{n}-{i}", 5000), DIGEST)
                self.stale = True  # (a key already stored is written again: a new sequence number all the same)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = DiskStore(self.dir.name, CONFIG, writer=True)
        self.stale = False

    @invariant()
    def rows_are_the_walk_unless_stale(self) -> None:
        assert kept(self.store) == walked(self.store)
        if not self.stale:
            assert current(self.store)

    def teardown(self) -> None:
        self.store.close()
        self.dir.cleanup()


TestNamespaceRows = NamespaceRows.TestCase
TestNamespaceRows.settings = settings(max_examples=20, stateful_step_count=20, deadline=None)


def _two_namespaces(root: str) -> tuple[bytes, bytes]:
    with DiskStore(root, CONFIG, writer=True) as s:
        a, b = s.register_namespace(VK), s.register_namespace(VK.bumped(model_id="b"))
        for i in range(5):
            s.store(make_key(a, f"a{i}"), make_payload(f"a{i}", 10_000), DIGEST)
        for i in range(3):
            s.store(make_key(b, f"b{i}"), make_payload(f"b{i}", 50_000), DIGEST)
    return a, b


def test_the_rows_are_read_not_counted(tmp_path) -> None:
    root = str(tmp_path)
    a, b = _two_namespaces(root)
    with DiskStore(root, readonly=True) as s, no_walk():
        got = kept(s)
    assert set(got) == {a, b} and got[a][0] == 5 and got[b][0] == 3
    with DiskStore(root, readonly=True) as s:
        assert got == walked(s)


def test_an_older_kvtier_swapping_one_record_for_another_leaves_the_rows_stale(tmp_path) -> None:
    """Both namespaces' records swap one of the same size: the form usage comes back to the same figures, the
    sequence number does not, so the stamp is stale and the rows are counted, not trusted."""
    root = str(tmp_path)
    a, b = _two_namespaces(root)
    with DiskStore(root, CONFIG, writer=True) as s, a_kvtier_without_the_rows():
        before = s.stats()["forms"]
        assert s.remove([make_key(b, "b0")]) == 1
        s.store(make_key(a, "a-new"), make_payload("b0", 50_000), DIGEST)
        assert s.stats()["forms"] == before
    with DiskStore(root, readonly=True) as s:
        assert not current(s)
        assert kept(s) == walked(s) and kept(s)[a][0] == 6 and kept(s)[b][0] == 2
    with DiskStore(root, CONFIG, writer=True) as s:  # the writer's open counts them again
        assert current(s)
    with DiskStore(root, readonly=True) as s, no_walk():
        assert kept(s)[a][0] == 6 and kept(s)[b][0] == 2


def test_a_store_from_before_the_rows_is_counted_once_at_the_writers_open(tmp_path, caplog) -> None:
    root = str(tmp_path)
    _two_namespaces(root)

    def forget_the_rows(txn) -> None:
        with txn.cursor(db=s.index.meta) as cur:
            more = cur.set_range(ns_usage.ROW_PREFIX)
            while more and bytes(cur.key()).startswith(ns_usage.ROW_PREFIX):
                more = cur.delete()
        txn.delete(ns_usage.STAMP, db=s.index.meta)

    with DiskStore(root) as s:
        expected = walked(s)
        s.index.update(forget_the_rows)
    with DiskStore(root, readonly=True) as s:
        assert not current(s) and kept(s) == expected  # a reader counts while they are stale
    with caplog.at_level("INFO", logger="kvtier.store.ns_usage"), DiskStore(root, CONFIG, writer=True) as s:
        assert current(s)
    assert "counted 8 records per namespace" in caplog.text
    caplog.clear()
    log = caplog.at_level("INFO", logger="kvtier.store.ns_usage")
    with log, DiskStore(root, CONFIG, writer=True) as s, no_walk():
        assert kept(s) == expected
    assert "counted" not in caplog.text  # current rows are not counted again


def test_a_corrupt_row_is_counted_around_until_the_next_writers_open(tmp_path) -> None:
    root = str(tmp_path)
    a, b = _two_namespaces(root)
    with DiskStore(root, CONFIG, writer=True) as s:
        expected = walked(s)
        row = ns_usage.ROW_PREFIX + a
        s.index.update(lambda txn: txn.put(row, b"\x00" * 24, db=s.index.meta))  # its seal fails
        assert kept(s) == expected
        s.store(make_key(b, "b-more"), make_payload("b-more", 7000), DIGEST)
        assert kept(s) == walked(s)
    with DiskStore(root, CONFIG, writer=True) as s, no_walk():
        assert kept(s) == walked(s)


@pytest.mark.parametrize("records", [0, 1])
def test_an_empty_namespace_has_no_row(tmp_path, records: int) -> None:
    with DiskStore(str(tmp_path), CONFIG, writer=True) as s:
        ns = s.register_namespace(VK)
        key = make_key(ns, "only")
        s.store(key, make_payload("only", 3000), DIGEST)
        if not records:
            s.remove([key])
        with s.index.read() as txn:
            assert (txn.get(ns_usage.ROW_PREFIX + ns, db=s.index.meta) is not None) == bool(records)
        assert kept(s) == walked(s)
