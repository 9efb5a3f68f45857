"""DiskStore as a LowerTier: round trips, namespaces, codecs, pins, budgets, roles, format refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import lmdb
import pytest
import torch

from kvtier.core import CacheForm, Reason
from kvtier.core.tier import LoadRequest, LowerTier
from kvtier.store import (
    DiskStore,
    FormatVersionError,
    NamespaceError,
    StoreConfig,
    StoreError,
    StoreForkError,
    StoreFull,
    StoreLocked,
    StoreReadOnly,
    StoreRequestError,
)
from kvtier.store import index as index_mod
from kvtier.store.record import record_length
from support.store_helpers import DIGEST, VK, make_key, make_payload, subprocess_env


@pytest.fixture
def store(tmp_path):
    s = DiskStore(str(tmp_path), StoreConfig(io_threads=3), writer=True)
    yield s
    s.close()


def _load(store: DiskStore, key, n: int, digest: bytes = DIGEST) -> tuple[Reason, torch.Tensor]:
    out = torch.full((n,), 0xAA, dtype=torch.uint8)
    return store.load_into([LoadRequest(key, out, digest)])[0], out


def test_round_trip_batched_and_protocol(store: DiskStore) -> None:
    assert isinstance(store, LowerTier)
    assert store.io_backend == "odirect"  # /tmp here is ext4
    ns = store.register_namespace(VK)
    keys = [make_key(ns, f"b{i}") for i in range(12)]
    payloads = [make_payload(f"b{i}", 5000 + 4096 * i) for i in range(12)]
    store.store_many(list(zip(keys, payloads, [DIGEST] * 12)))
    outs = [torch.zeros_like(p) for p in payloads]
    assert store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]) == [Reason.OK] * 12
    assert all(torch.equal(o, p) for o, p in zip(outs, payloads))
    # A view of a larger pool (a slot) is a valid target.
    pool = torch.zeros(3, payloads[2].numel(), dtype=torch.uint8)
    assert store.load_into([LoadRequest(keys[2], pool[1], DIGEST)]) == [Reason.OK]
    assert torch.equal(pool[1], payloads[2]) and not pool[0].any() and not pool[2].any()
    stats = store.stats()
    assert stats["records"] == 12
    assert stats["record_bytes"] == sum(record_length(p.numel()) for p in payloads)


def test_store_is_idempotent_and_durable_across_reopen(tmp_path) -> None:
    with DiskStore(str(tmp_path), writer=True) as s:
        ns = s.register_namespace(VK)
        k = make_key(ns, "x")
        s.store(k, make_payload("x", 10000), DIGEST)
        s.store(k, make_payload("x", 10000), DIGEST)
        assert s.stats()["records"] == 1
    with DiskStore(str(tmp_path)) as s:
        reason, out = _load(s, k, 10000)
        assert reason is Reason.OK and torch.equal(out, make_payload("x", 10000))


def test_a_load_starts_no_thread_and_its_access_times_reach_the_index(tmp_path) -> None:
    """The store's threads start when it opens: a thread start costs milliseconds on a busy host, which a load
    of small records would pay on its clock."""
    with DiskStore(str(tmp_path), writer=True) as w:
        key = make_key(w.register_namespace(VK), "t")
        w.store(key, make_payload("t", 3000), DIGEST)
    with DiskStore(str(tmp_path), StoreConfig(atime_flush_s=3600)) as s:
        before = {t.ident for t in threading.enumerate()}
        started = time.time()
        assert _load(s, key, 3000)[0] is Reason.OK
        loaded = time.time()
        assert {t.ident for t in threading.enumerate()} == before
    with DiskStore(str(tmp_path), readonly=True) as r, r.index.read() as txn:  # written at close
        assert started <= index_mod.unpack_time(txn.get(index_mod.encode_key(key), db=r.index.atime)) <= loaded


def test_namespaces_are_isolated_and_retirement_is_stale(store: DiskStore) -> None:
    ns_a = store.register_namespace(VK)
    ns_b = store.register_namespace(VK.bumped(compression_version="comp-2"))
    ka = make_key(ns_a, "same-hash")
    kb = make_key(ns_b, "same-hash")
    assert ka.block_hash == kb.block_hash
    store.store(ka, make_payload("a", 8192), DIGEST)
    assert store.has([ka, kb], [DIGEST, DIGEST]) == [Reason.OK, Reason.MISSING]
    assert _load(store, kb, 8192)[0] is Reason.MISSING
    unknown = make_key(b"\x01" * 16, "same-hash")
    assert store.has([unknown], [DIGEST]) == [Reason.MISSING]
    with pytest.raises(NamespaceError):
        store.store(unknown, make_payload("u", 100), DIGEST)
    assert store.retire_namespace(ns_a)
    reason, out = _load(store, ka, 8192)
    assert reason is Reason.STALE_VERSION and (out == 0xAA).all()
    with pytest.raises(NamespaceError, match="retired"):
        store.store(make_key(ns_a, "new"), make_payload("n", 100), DIGEST)
    assert not store.namespaces()[ns_a].live and store.namespaces()[ns_a].version_key == VK


def test_a_namespace_s_state_is_read_at_every_load(store: DiskStore) -> None:
    """A store keeps the reason a namespace's index value gave (not decoded at every load), so a change to the
    value must show at the next load: retired after a load, then registered again."""
    ns = store.register_namespace(VK)
    key = make_key(ns, "ns-state")
    store.store(key, make_payload("s", 4096), DIGEST)
    assert _load(store, key, 4096)[0] is Reason.OK
    assert store.retire_namespace(ns)
    assert _load(store, key, 4096)[0] is Reason.STALE_VERSION
    store.register_namespace(VK)
    reason, out = _load(store, key, 4096)
    assert reason is Reason.OK and torch.equal(out, make_payload("s", 4096))


def test_layout_mismatch_and_wrong_slot_size_are_abi_mismatch(store: DiskStore) -> None:
    ns = store.register_namespace(VK)
    k = make_key(ns, "abi")
    store.store(k, make_payload("abi", 4096), DIGEST)
    assert store.has([k], [b"M" * 16]) == [Reason.ABI_MISMATCH]
    assert _load(store, k, 4096, b"M" * 16)[0] is Reason.ABI_MISMATCH
    reason, out = _load(store, k, 4095)
    assert reason is Reason.ABI_MISMATCH and (out == 0xAA).all()


def test_zstd_codec_per_form_reports_ratio(store: DiskStore) -> None:
    ns = store.register_namespace(VK, codecs={CacheForm.SWA: "zstd"})
    swa = make_key(ns, "swa", "swa", CacheForm.SWA)
    c4 = make_key(ns, "c4")
    compressible = torch.arange(200_000, dtype=torch.int64).div(512, rounding_mode="floor").to(torch.uint8)
    store.store(swa, compressible, DIGEST)
    store.store(c4, compressible, DIGEST)
    forms = store.stats()["forms"]
    assert forms["swa"]["codec_ratio"] > 20 and forms["compressed"]["codec_ratio"] == 1.0
    assert forms["swa"]["record_bytes"] < forms["compressed"]["record_bytes"]
    reason, out = _load(store, swa, 200_000)
    assert reason is Reason.OK and torch.equal(out, compressible)


def test_pin_extends_and_counts(store: DiskStore) -> None:
    ns = store.register_namespace(VK)
    k = make_key(ns, "p")
    store.store(k, make_payload("p", 100), DIGEST)
    assert store.pin([k, make_key(ns, "absent")], ttl_s=60) == 1
    first = store.iter_records()[0].entry.pin_until
    assert store.pin([k], ttl_s=1) == 1
    assert store.iter_records()[0].entry.pin_until == first  # never shortened
    assert store.pin([k], ttl_s=120) == 1 and store.iter_records()[0].entry.pin_until > first


def test_remove_makes_a_miss_and_updates_accounting(store: DiskStore) -> None:
    ns = store.register_namespace(VK)
    keys = [make_key(ns, f"r{i}") for i in range(3)]
    for i, k in enumerate(keys):
        store.store(k, make_payload(f"r{i}", 9000), DIGEST)
    assert store.remove([keys[0], keys[0], make_key(ns, "absent")]) == 1
    assert store.has(keys, [DIGEST] * 3) == [Reason.MISSING, Reason.OK, Reason.OK]
    assert store.stats()["records"] == 2
    (seg,) = store.segments().values()
    assert seg.referenced == 2 * record_length(9000) and seg.records == 2


def test_eviction_leaves_a_tombstone_until_stored_again_or_pruned(store: DiskStore) -> None:
    ns = store.register_namespace(VK)
    keys = [make_key(ns, f"e{i}") for i in range(4)]
    store.store_many([(k, make_payload(f"e{i}", 9000), DIGEST) for i, k in enumerate(keys)])
    assert store.evict(keys[:3], when=lambda key, e: key != keys[2]) == 2  # the cleaner's condition holds
    assert store.remove([keys[3]]) == 1  # removal is not eviction: no tombstone
    assert store.has(keys, [DIGEST] * 4) == [Reason.EVICTED, Reason.EVICTED, Reason.OK, Reason.MISSING]
    assert _load(store, keys[0], 9000)[0] is Reason.EVICTED
    assert store.stats()["records"] == 1 and store.stats()["evicted_tombstones"] == 2
    store.store(keys[0], make_payload("e0", 9000), DIGEST)  # stored again: the tombstone goes in the same commit
    assert _load(store, keys[0], 9000)[0] is Reason.OK and store.stats()["evicted_tombstones"] == 1
    # pruning: nothing is older than a minute ago; everything is older than a minute from now, in bounded scans
    assert store.prune_tombstones(time.time() - 60) == (0, b"")
    store.evict([keys[2]])
    _, second = sorted(index_mod.encode_key(k) for k in keys[1:3])
    assert store.prune_tombstones(time.time() + 60, scan=1) == (1, second)
    assert store.prune_tombstones(time.time() + 60, start=second, scan=1) == (1, b"")
    assert store.has(keys[1:3], [DIGEST] * 2) == [Reason.MISSING, Reason.MISSING]
    assert store.stats()["evicted_tombstones"] == 0


def test_a_store_without_the_tombstone_db_opens_read_only(tmp_path) -> None:
    """An index written before `gone` existed (no writer since): readers see plain misses."""
    with DiskStore(str(tmp_path), writer=True) as s:
        ns = s.register_namespace(VK)
        s.store(make_key(ns, "old"), make_payload("old", 9000), DIGEST)
    env = lmdb.open(os.path.join(str(tmp_path), index_mod.INDEX_DIR), max_dbs=len(index_mod.DB_NAMES))
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"gone", txn=txn), delete=True)
    env.close()
    with DiskStore(str(tmp_path), readonly=True) as s:
        assert s.has([make_key(ns, "old"), make_key(ns, "new")], [DIGEST] * 2) == [Reason.OK, Reason.MISSING]
        assert s.stats()["evicted_tombstones"] == 0


def test_budget_and_quota_refuse_with_nothing_visible_nothing_deleted(tmp_path) -> None:
    rec = record_length(50_000)
    cfg = StoreConfig(budget_bytes=3 * rec, form_quotas=StoreConfig.quotas({CacheForm.SWA: rec}))
    with DiskStore(str(tmp_path), cfg, writer=True) as s:
        ns = s.register_namespace(VK)
        for i in range(3):
            s.store(make_key(ns, f"k{i}"), make_payload(f"k{i}", 50_000), DIGEST)
        with pytest.raises(StoreFull) as exc:
            s.store(make_key(ns, "k3"), make_payload("k3", 50_000), DIGEST)
        assert exc.value.limit == "budget" and exc.value.code == "store_full"
        assert s.has([make_key(ns, f"k{i}") for i in range(4)], [DIGEST] * 4) == [Reason.OK] * 3 + [Reason.MISSING]
        s.remove([make_key(ns, "k0"), make_key(ns, "k1")])
        s.store(make_key(ns, "swa0", "swa", CacheForm.SWA), make_payload("s0", 50_000), DIGEST)
        with pytest.raises(StoreFull) as exc:
            s.store(make_key(ns, "swa1", "swa", CacheForm.SWA), make_payload("s1", 50_000), DIGEST)
        assert exc.value.limit == "quota:swa"
        assert s.has([make_key(ns, "swa1", "swa", CacheForm.SWA)], [DIGEST]) == [Reason.MISSING]


def test_a_batch_is_refused_once_its_new_records_found_so_far_do_not_fit(tmp_path) -> None:
    """Admission stops at the first new record that does not fit: the keys after it are not looked up and count
    as new, so the refusal's `needed` is an upper bound ("up to"). A batch of records the store holds already, or
    one whose new records fit, goes in; a namespace that is not registered is named even after the refusal point."""
    rec = record_length(50_000)
    with DiskStore(str(tmp_path), StoreConfig(budget_bytes=3 * rec), writer=True) as s:
        ns = s.register_namespace(VK)
        held = [(make_key(ns, f"k{i}"), make_payload(f"k{i}", 50_000), DIGEST) for i in range(2)]
        s.store_many(held)  # room for one record more
        new = [(make_key(ns, f"n{i}"), make_payload(f"n{i}", 50_000), DIGEST) for i in range(2)]
        with pytest.raises(StoreFull) as exc:
            s.store_many(new + held)  # over at the second new record: the held two after it are counted as new
        left = exc.value.left
        assert (left.limit, left.room, left.needed) == ("budget", rec, 4 * rec)
        assert "up to" in str(exc.value)
        with pytest.raises(StoreFull) as exc:
            s.store_many(held + new)  # every key before the refusal point looked up: the figures are exact
        assert (exc.value.left.room, exc.value.left.needed) == (rec, 2 * rec) and "up to" not in str(exc.value)
        s.store_many(held + new[:1])  # the new one fits
        assert s.has([k for k, _, _ in held + new], [DIGEST] * 4) == [Reason.OK] * 3 + [Reason.MISSING]
        stranger = (make_key(b"\x02" * 16, "x"), make_payload("x", 50_000), DIGEST)
        with pytest.raises(NamespaceError, match="not registered"):
            s.store_many([*new, stranger])


def test_roles_locks_and_bad_input_are_typed(tmp_path) -> None:
    with DiskStore(str(tmp_path), writer=True) as w:
        ns = w.register_namespace(VK)
        with pytest.raises(StoreLocked, match="writer"):
            DiskStore(str(tmp_path), writer=True)
        with pytest.raises(StoreError, match="already open in this process"):
            DiskStore(str(tmp_path))
        for bad in (
            torch.zeros(10, dtype=torch.float32),
            torch.zeros(4, 4, dtype=torch.uint8).t(),
            torch.zeros(0, dtype=torch.uint8),
        ):
            with pytest.raises(StoreRequestError):
                w.store(make_key(ns, "bad"), bad, DIGEST)
            with pytest.raises(StoreRequestError):
                w.load_into([LoadRequest(make_key(ns, "bad"), bad, DIGEST)])
        with pytest.raises(StoreRequestError):
            w.has([make_key(ns, "x")], [])
    with DiskStore(str(tmp_path), writer=True) as w:
        ns = w.register_namespace(VK)
        keys = [make_key(ns, f"g{i}") for i in range(40)]
        payloads = [make_payload(f"g{i}", 1000 + i) for i in range(40)]
        w.store_many(list(zip(keys, payloads, [DIGEST] * 40)))
        # One bad target among many good ones is named (the columns check them all at once); nothing is loaded
        for bad in (
            bytearray(1020),
            torch.zeros(1020, dtype=torch.int8),
            torch.zeros(2, 2040, dtype=torch.uint8)[:, ::2],
        ):
            outs: list = [torch.zeros_like(p) for p in payloads]
            outs[20] = bad
            with pytest.raises(StoreRequestError, match="non-empty contiguous uint8"):
                w.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
            assert not any(o.any() for o in outs if isinstance(o, torch.Tensor) and o.dtype == torch.uint8)
        # A contiguous target of any shape is its bytes in order
        shaped = [torch.zeros(2, p.numel() // 2, dtype=torch.uint8) for p in payloads if p.numel() % 2 == 0]
        even = [(k, p) for k, p in zip(keys, payloads) if p.numel() % 2 == 0]
        assert w.load_into([LoadRequest(k, o, DIGEST) for (k, _), o in zip(even, shaped)]) == [Reason.OK] * len(even)
        assert all(torch.equal(o.flatten(), p) for (_, p), o in zip(even, shaped))
    with DiskStore(str(tmp_path)) as r, pytest.raises(StoreReadOnly):
        r.store(make_key(ns, "x"), make_payload("x", 10), DIGEST)


def test_use_after_fork_is_refused(store: DiskStore) -> None:
    ns = store.register_namespace(VK)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: any use must raise before touching LMDB
        try:
            store.has([make_key(ns, "x")], [DIGEST])
            os.write(wfd, b"no-error")
        except StoreForkError:
            os.write(wfd, b"refused")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 64) == b"refused"


def test_newer_index_format_is_refused(tmp_path) -> None:
    DiskStore(str(tmp_path)).close()
    env = lmdb.open(str(tmp_path / "index.lmdb"), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format_version", index_mod.seal((99).to_bytes(8, "big")), db=meta)
    env.close()
    with pytest.raises(FormatVersionError, match=r"v99.*upgrade kvtier"):
        DiskStore(str(tmp_path))


def test_map_grows_on_full_and_other_process_adopts_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(index_mod, "INITIAL_MAP_BYTES", 256 << 10)
    with DiskStore(str(tmp_path), writer=True) as s:
        ns = s.register_namespace(VK)
        s.store(make_key(ns, "first"), make_payload("first", 100), DIGEST)
        reader = subprocess.Popen(
            [sys.executable, "-c", _READER, str(tmp_path)],
            env=subprocess_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert reader.stdout.readline().split() == ["ready", "OK", "MISSING"]
            s.store_many([(make_key(ns, f"g{i}"), make_payload("tiny", 16), DIGEST) for i in range(3000)])
            assert s.index.env.info()["map_size"] > 256 << 10
            reader.stdin.write("go\n")
            reader.stdin.flush()
            assert reader.stdout.readline().split() == ["OK", "OK"]
        finally:
            reader.kill()
            reader.wait()


# Opens the store before the writer grows the map, then reads after: it must adopt the new size.
_READER = """
import sys
from kvtier.store import DiskStore
from support.store_helpers import DIGEST, VK, make_key
s = DiskStore(sys.argv[1])
ns = VK.namespace
keys = [make_key(ns, "first"), make_key(ns, "g2999")]
print("ready", *(r.name for r in s.has(keys, [DIGEST] * 2)), flush=True)
sys.stdin.readline()
print(*(r.name for r in s.has(keys, [DIGEST] * 2)), flush=True)
"""


def test_one_batch_spanning_several_segments(tmp_path) -> None:
    with DiskStore(str(tmp_path), StoreConfig(segment_bytes=200_000, io_threads=4), writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"roll{i}") for i in range(40)]
        s.store_many([(k, make_payload(f"roll{i}", 30_000 + i), DIGEST) for i, k in enumerate(keys)])
        segs = s.segments()
        assert len(segs) >= 6 and sum(e.sealed for e in segs.values()) == len(segs) - 1
        assert sum(e.records for e in segs.values()) == 40
        assert all(e.tail <= 200_000 for e in segs.values())
    with DiskStore(str(tmp_path)) as s:
        outs = [torch.empty(30_000 + i, dtype=torch.uint8) for i in range(40)]
        assert s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]) == [Reason.OK] * 40
        assert all(torch.equal(o, make_payload(f"roll{i}", 30_000 + i)) for i, o in enumerate(outs))


def test_store_stats_cli_reports_records_and_remembered_evictions(tmp_path) -> None:
    from click.testing import CliRunner

    from kvtier.cli.main import cli
    from kvtier.core.units import format_bytes

    with DiskStore(str(tmp_path), writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"c{i}") for i in range(3)]
        s.store_many([(k, make_payload(f"c{i}", 9000), DIGEST) for i, k in enumerate(keys)])
        s.evict(keys[:2])
    human = CliRunner().invoke(cli, ["store", "stats", "--store", str(tmp_path)])
    assert human.exit_code == 0, human.output
    # one size format (binary units), no Python reprs (None, dicts) in the text
    size = format_bytes(record_length(9000))
    assert f"records     1, {size} on disk (payload 8.8 KiB), budget none" in human.output
    assert "evicted keys remembered 2" in human.output and "None" not in human.output and "{" not in human.output
    as_json = CliRunner().invoke(cli, ["store", "stats", "--store", str(tmp_path), "--json"])
    assert json.loads(as_json.output)["evicted_tombstones"] == 2


@pytest.mark.parametrize("bad", [{"atime_flush_s": 1e12}, {"atime_flush_s": -1.0}, {"read_threads": 0}])
def test_store_config_refuses_values_its_threads_cannot_run_with(bad) -> None:
    with pytest.raises(ValueError):
        StoreConfig(**bad)
