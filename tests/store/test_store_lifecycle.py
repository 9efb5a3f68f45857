"""Reader epochs before unlink, unlink outside the write lock and in synced steps, backend probing without a CUDA
driver, and a store state machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DiskStore, StoreConfig
from kvtier.store import compaction as compaction_mod
from kvtier.store.io import UNLINK_STEP_BYTES, unlink_in_steps
from kvtier.store.segments import segment_name
from support.store_helpers import DIGEST, VK, make_key, make_payload, subprocess_env

_HOLD_READ_TXN = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=8, readonly=True)
txn = env.begin()
print("holding", txn.id(), flush=True)
sys.stdin.readline()
txn.abort()
print("released", flush=True)
sys.stdin.readline()
"""


def _reader(root: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLD_READ_TXN, os.path.join(root, "index.lmdb")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().startswith("holding")
    return p


def _six_records(s: DiskStore, tag: str) -> list[ObjectKey]:
    """Six 40 KB records stored one by one (in 64 KiB segments, each sealed as the next one starts)."""
    ns = s.register_namespace(VK)
    keys = [make_key(ns, f"{tag}{i}") for i in range(6)]
    for i, k in enumerate(keys):
        s.store(k, make_payload(f"{tag}{i}", 40_000), DIGEST)
    return keys


def test_segment_is_unlinked_only_after_every_reader_that_could_see_it_is_gone(tmp_path) -> None:
    root = str(tmp_path)
    with DiskStore(root, StoreConfig(segment_bytes=64 << 10), writer=True) as s:
        keys = _six_records(s, "e")
        segs = s.segments()
        first = min(segs)
        active = max(segs)
        in_first = [r.key for r in s.iter_records() if r.entry.segment == first]
        assert not s.try_unlink_segment(active)  # unsealed: the appender still owns it
        assert not s.try_unlink_segment(first)  # still referenced
        graceful, killed = _reader(root), _reader(root)  # snapshots taken before the drop
        assert s.drop(in_first) == len(in_first)
        path = os.path.join(root, "segments", segment_name(first))
        assert not s.try_unlink_segment(first) and os.path.exists(path)
        graceful.stdin.write("\n")
        graceful.stdin.flush()
        assert graceful.stdout.readline().strip() == "released"
        assert not s.try_unlink_segment(first)  # the other reader still has an older snapshot
        os.kill(killed.pid, signal.SIGKILL)  # a reader that dies holding a txn is cleared by reader_check()
        killed.wait()
        assert s.try_unlink_segment(first) and not os.path.exists(path)
        graceful.kill()
        graceful.wait()
        rest = [k for k in keys if k not in in_first]
        outs = [torch.empty(40_000, dtype=torch.uint8) for _ in rest]
        assert s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(rest, outs)]) == [Reason.OK] * len(rest)
        assert s.has(in_first, [DIGEST] * len(in_first)) == [Reason.MISSING] * len(in_first)


def test_a_segment_file_is_unlinked_outside_the_index_write_lock(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeing a large file's extents can take the filesystem a while; a write committed from another thread while
    the unlink runs must not wait for it (it would if the unlink ran inside the write transaction)."""
    with DiskStore(str(tmp_path), StoreConfig(segment_bytes=64 << 10), writer=True) as s:
        _six_records(s, "u")
        first = min(s.segments())
        assert s.drop([r.key for r in s.iter_records() if r.entry.segment == first]) > 0
        committed: list[bool] = []
        writer = threading.Thread(target=lambda: s.index.update(lambda txn: None))
        real_unlink = os.unlink

        def unlink_while_another_thread_writes(path: str) -> None:
            writer.start()
            writer.join(30)  # a bound for the failure only: behind this thread's open transaction it cannot end
            committed.append(not writer.is_alive())
            real_unlink(path)

        monkeypatch.setattr(compaction_mod.os, "unlink", unlink_while_another_thread_writes)
        assert s.try_unlink_segment(first)
        writer.join()
        assert committed == [True]
        assert first not in s.segments() and not os.path.exists(tmp_path / "segments" / segment_name(first))


@pytest.fixture
def synced_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of the file each os.fsync call syncs, in order (the real fsync still runs)."""
    sizes: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        sizes.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return sizes


def test_unlink_in_steps_cuts_the_file_from_its_end_syncing_each_cut(tmp_path, synced_sizes: list[int]) -> None:
    path = tmp_path / "seg"
    path.write_bytes(os.urandom(5 << 20))
    assert unlink_in_steps(str(path), step=2 << 20)
    assert synced_sizes == [3 << 20, 1 << 20] and not path.exists()
    assert not unlink_in_steps(str(path), step=2 << 20)  # already gone: nothing to do, no error


def test_a_file_it_may_not_write_is_still_unlinked_whole(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's stray in a directory this process may write: no cuts (it cannot open the file to write),
    but the unlink it could always do still happens."""
    path = tmp_path / "stray"
    path.write_bytes(os.urandom(3 << 20))
    real_open = os.open

    def open_as_another_user(p: str, flags: int, *args: int) -> int:
        if p == str(path) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", p)
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", open_as_another_user)
    assert unlink_in_steps(str(path), step=1 << 20) and not path.exists()


def test_an_uncommitted_tail_is_trimmed_in_synced_steps(tmp_path, synced_sizes: list[int]) -> None:
    """Bytes a crashed batch left past a sealed segment's committed tail go as a deleted segment's do: cut from the
    end in synced steps, then the rest; the segment's records still read back."""
    with DiskStore(str(tmp_path), StoreConfig(segment_bytes=64 << 10), writer=True) as s:
        keys = _six_records(s, "t")
        first = min(s.segments())
        tail = s.segments()[first].tail
        path = tmp_path / "segments" / segment_name(first)
        with open(path, "ab") as f:
            f.write(os.urandom(UNLINK_STEP_BYTES + (3 << 20)))
        before = path.stat().st_size
        synced_sizes.clear()  # (the store's own directory syncs so far)
        assert s.trim_segment(first) == before - tail
        assert synced_sizes == [before - UNLINK_STEP_BYTES] and path.stat().st_size == tail
        segment_of = {r.key: r.entry.segment for r in s.iter_records()}
        in_first = [(i, k) for i, k in enumerate(keys) if segment_of[k] == first]
        assert in_first
        outs = [torch.empty(40_000, dtype=torch.uint8) for _ in in_first]
        assert s.load_into([LoadRequest(k, o, DIGEST) for (_, k), o in zip(in_first, outs)]) == [Reason.OK] * len(outs)
        assert all(torch.equal(o, make_payload(f"t{i}", 40_000)) for (i, _), o in zip(in_first, outs))


_KILLED_AFTER_ONE_STEP = """
import os, signal, sys
from kvtier.store import DiskStore, StoreConfig
real_fsync = os.fsync
def fsync(fd):
    real_fsync(fd)
    print(os.fstat(fd).st_size, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # right after the first cut is synced
os.fsync = fsync
DiskStore(sys.argv[1], StoreConfig(segment_bytes=int(sys.argv[3])), writer=True).try_unlink_segment(int(sys.argv[2]))
"""


def test_a_segment_deleted_part_way_when_killed_is_deleted_by_the_next_call(tmp_path) -> None:
    """A segment larger than a step is cut from its end in synced steps; killed (-9) after the first, it keeps its
    entry and is shorter by one step, the other records read back, and the next call deletes file and entry."""
    root, seg_bytes, size = str(tmp_path), 32 << 20, 4 << 20
    cfg = StoreConfig(segment_bytes=seg_bytes)
    with DiskStore(root, cfg, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"k{i}") for i in range(10)]
        s.store_many([(k, make_payload(f"k{i}", size), DIGEST) for i, k in enumerate(keys)])
        first = min(s.segments())
        in_first = [r.key for r in s.iter_records() if r.entry.segment == first]
        assert s.drop(in_first) == len(in_first)
    path = os.path.join(root, "segments", segment_name(first))
    before = os.path.getsize(path)
    assert before > UNLINK_STEP_BYTES
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_ONE_STEP, root, str(first), str(seg_bytes)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert int(child.stdout) == os.path.getsize(path) == before - UNLINK_STEP_BYTES
    with DiskStore(root, cfg, writer=True) as s:
        assert first in s.segments()
        rest = [k for k in keys if k not in in_first]
        outs = [torch.empty(size, dtype=torch.uint8) for _ in rest]
        assert s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(rest, outs)]) == [Reason.OK] * len(rest)
        assert all(torch.equal(o, make_payload(f"k{keys.index(k)}", size)) for k, o in zip(rest, outs))
        assert s.try_unlink_segment(first)
        assert first not in s.segments() and not os.path.exists(path)


_PROBE = """
import sys
from kvtier.store import DiskStore
from kvtier.store.io import cuda_driver_present
s = DiskStore(sys.argv[1], writer=True)
print(cuda_driver_present(), s.io_backend, "kvikio" in sys.modules)
s.close()
try:
    DiskStore(sys.argv[1], __import__("kvtier.store", fromlist=["StoreConfig"]).StoreConfig(io_backend="gds"))
except Exception as exc:
    print(type(exc).__name__, getattr(exc, "code", None))
"""


def test_without_a_cuda_driver_kvikio_is_never_imported(tmp_path) -> None:
    poison = tmp_path / "poison" / "kvikio"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise SystemExit('kvikio imported without a CUDA driver')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = f"{poison.parent}{os.pathsep}{env['PYTHONPATH']}"
    res = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "s")], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "odirect", "False", "StoreError", "store_error"]


class StoreMachine(RuleBasedStateMachine):
    """store / remove / retire / reopen against a dict model: reads answer exactly what the model says."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory(prefix="kvtier-sm-")
        self.store = DiskStore(self.dir.name, StoreConfig(segment_bytes=128 << 10, io_threads=2), writer=True)
        self.ns = [self.store.register_namespace(VK), self.store.register_namespace(VK.bumped(model_id="other"))]
        self.model: dict = {}
        self.retired: set[bytes] = set()

    def _key(self, n: int, i: int):
        return make_key(self.ns[n], f"sm{i}")

    @rule(n=st.integers(0, 1), i=st.integers(0, 7), size=st.sampled_from([1, 4095, 4096, 20_000]))
    def put(self, n: int, i: int, size: int) -> None:
        key = self._key(n, i)
        if self.ns[n] in self.retired:
            return
        self.store.store(key, make_payload(f"{n}-{i}-{size}", size), DIGEST)
        self.model.setdefault(key, (f"{n}-{i}-{size}", size))  # immutable: a second store is a no-op

    @rule(n=st.integers(0, 1), i=st.integers(0, 7))
    def remove(self, n: int, i: int) -> None:
        key = self._key(n, i)
        assert self.store.remove([key]) == (1 if key in self.model else 0)
        self.model.pop(key, None)

    @precondition(lambda self: not self.retired)
    @rule()
    def retire_second(self) -> None:
        self.store.retire_namespace(self.ns[1])
        self.retired.add(self.ns[1])

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = DiskStore(self.dir.name, StoreConfig(segment_bytes=128 << 10, io_threads=2), writer=True)

    @invariant()
    def reads_match_model(self) -> None:
        keys = [self._key(n, i) for n in (0, 1) for i in range(8)]
        sizes = [self.model.get(k, ("", 16))[1] for k in keys]
        outs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        reasons = self.store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
        for k, r, o in zip(keys, reasons, outs):
            if k.namespace in self.retired:
                assert r is Reason.STALE_VERSION
            elif k in self.model:
                tag, size = self.model[k]
                assert r is Reason.OK and torch.equal(o, make_payload(tag, size))
            else:
                assert r is Reason.MISSING
        live = [k for k in self.model]
        assert self.store.stats()["records"] == len(live)

    def teardown(self) -> None:
        self.store.close()
        self.dir.cleanup()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=15, stateful_step_count=15, deadline=None)
