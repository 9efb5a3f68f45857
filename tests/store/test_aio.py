"""Native AIO reads (kvtier.store.aio) on a real O_DIRECT file: bytes, end of file, failures, fork, and a store load
through a queue far smaller than the load, and a load whose first requests send no read."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import random

import pytest
import torch

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, StoreConfig, aio
from kvtier.store import packed as packed_mod
from kvtier.store.io import AlignedBuffer, PosixBackend
from support.store_helpers import DIGEST, VK, make_key, make_payload

SIZE = 1 << 20


@pytest.fixture
def ctx():
    c = aio.acquire()
    if c is None:
        pytest.skip("native AIO is not available on this machine")
    yield c
    aio.release(c)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "seg"
    data = random.Random(7).randbytes(SIZE)
    path.write_bytes(data)
    f = PosixBackend(direct=True).open(str(path))
    yield f, data
    f.close()


def _op(f, views: list[memoryview], offset: int, tag: object = None) -> aio.ReadOp:
    return aio.ReadOp(f, aio.iov_of(views), offset, tag)


def _all(ctx: aio.AioContext) -> dict[object, int]:
    done: dict[object, int] = {}
    while ctx.pending:
        for op, n in ctx.complete():
            done[op.tag] = n
    return done


def test_reads_in_flight_together_fill_every_view(ctx, data_file) -> None:
    f, data = data_file
    buf = AlignedBuffer(SIZE)
    offsets = random.Random(1).sample(range(0, SIZE, 4096), 200)
    for i, off in enumerate(offsets):  # two views a read: 4 KiB where the file has it, in two halves
        ctx.submit([_op(f, [buf.mv[off : off + 1024], buf.mv[off + 1024 : off + 4096]], off, i)])
    assert ctx.pending_bytes == 4096 * len(offsets)
    assert _all(ctx) == {i: 4096 for i in range(len(offsets))}
    assert ctx.pending_bytes == 0
    assert all(buf.mv[o : o + 4096] == data[o : o + 4096] for o in offsets)


def test_a_read_across_end_of_file_returns_what_is_there(ctx, data_file) -> None:
    f, data = data_file
    buf = AlignedBuffer(3 * 4096)
    ctx.submit([_op(f, [buf.mv[: 2 * 4096]], SIZE - 4096, "across")])
    ctx.submit([_op(f, [buf.mv[2 * 4096 :]], SIZE, "past")])
    assert _all(ctx) == {"across": 4096, "past": 0}
    assert buf.mv[:4096] == data[-4096:]


def test_a_failed_read_is_raised_once_the_others_are_in(ctx, data_file) -> None:
    f, data = data_file
    buf = AlignedBuffer(4 * 4096)
    ctx.submit([_op(f, [buf.mv[:4096]], 0, "good")])
    ctx.submit([_op(f, [buf.mv[4096 + 1 : 2 * 4096 + 1]], 4096, "misaligned")])  # O_DIRECT: EINVAL
    ctx.submit([_op(f, [buf.mv[3 * 4096 :]], 8192, "good too")])
    seen: list[object] = []
    with pytest.raises(OSError) as err:
        while ctx.pending:
            seen += [op.tag for op, _ in ctx.complete()]
    assert err.value.errno == 22 and ctx.pending == 0
    assert buf.mv[:4096] == data[:4096] and buf.mv[3 * 4096 :] == data[8192 : 3 * 4096]


def test_a_forked_child_sets_up_its_own_context(ctx, data_file) -> None:
    f, data = data_file
    aio.release(aio.acquire())  # the parent holds a spare context the child must not use
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            c = aio.acquire()
            buf = AlignedBuffer(4096)
            c.submit([_op(f, [buf.mv[:4096]], 4096)])
            ok = [n for _, n in c.complete()] == [4096] and buf.mv[:4096] == data[4096:8192]
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_load_of_more_runs_than_the_queue_holds(tmp_path, ctx, monkeypatch) -> None:
    """Hundreds of runs (no two records read together) through an AIO queue of 4: every record arrives intact."""
    monkeypatch.setattr(aio, "DEPTH", 4)
    monkeypatch.setattr(packed_mod, "RUN_GAP", 0)
    root = str(tmp_path / "store")
    n = 400
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"k{i}") for i in range(n)]
        s.store_many([(k, make_payload(f"k{i}", 1000), DIGEST) for i, k in enumerate(keys)])
    pick = sorted(random.Random(3).sample(range(n), 100))[::2]  # every other one: gaps, so many runs
    with DiskStore(root) as s:
        outs = [make_payload("x", 1000) for _ in pick]
        reasons = s.load_into([LoadRequest(keys[i], o, DIGEST) for i, o in zip(pick, outs)])
    assert reasons == [Reason.OK] * len(pick)
    assert all(o.equal(make_payload(f"k{i}", 1000)) for i, o in zip(pick, outs))


def test_reads_the_kernel_has_no_room_for_are_read_at_once(ctx, data_file, monkeypatch) -> None:
    """io_submit answering EAGAIN (the context's queue is full): the reads are done synchronously, not lost."""
    f, data = data_file
    real = aio._syscall

    def full(number, *args):
        if number == aio._SUBMIT:
            ctypes.set_errno(errno.EAGAIN)
            return -1
        return real(number, *args)

    monkeypatch.setattr(aio, "_syscall", full)
    buf = AlignedBuffer(2 * 4096)
    ctx.submit([_op(f, [buf.mv[:4096]], 0, "a"), _op(f, [buf.mv[4096:]], 65536, "b")])
    assert ctx.pending == 2 and _all(ctx) == {"a": 4096, "b": 4096} and ctx.pending_bytes == 0
    assert buf.mv[:4096] == data[:4096] and buf.mv[4096:] == data[65536 : 65536 + 4096]


def test_a_refused_io_setup_leaves_the_process_reading_with_threads(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(aio, "_free", [])
    monkeypatch.setattr(aio, "_refused", False)
    real = aio._syscall

    def refuse(number, *args):
        if number == aio._SETUP:
            ctypes.set_errno(errno.EAGAIN)  # fs.aio-max-nr reached
            return -1
        return real(number, *args)

    monkeypatch.setattr(aio, "_syscall", refuse)
    root = str(tmp_path / "store")
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"r{i}") for i in range(8)]
        s.store_many([(k, make_payload(f"r{i}", 5000), DIGEST) for i, k in enumerate(keys)])
    with caplog.at_level(logging.WARNING, logger="kvtier.store.aio"), DiskStore(root) as s:
        outs = [make_payload("x", 5000) for _ in keys]
        assert s.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]) == [Reason.OK] * len(keys)
        assert s.load_into([LoadRequest(keys[0], outs[0], DIGEST)]) == [Reason.OK]
    assert all(o.equal(make_payload(f"r{i}", 5000)) for i, o in enumerate(outs))
    assert sum("native AIO refused" in r.getMessage() for r in caplog.records) == 1  # said once, not per load
    assert aio._refused and aio.acquire() is None


def _one_extent(root: str, n: int, size: int):
    with DiskStore(root, writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"w{i}") for i in range(n)]
        s.store_many([(k, make_payload(f"w{i}", size), DIGEST) for i, k in enumerate(keys)])
        return keys, [r.entry for r in s.records(keys)]


@pytest.mark.parametrize("backend", ["odirect", "buffered"])
def test_a_load_with_nothing_to_read_first_still_asks_for_the_rest(tmp_path, ctx, backend) -> None:
    """The first requests all missing (no read goes out for them): `more` is called anyway, and its keys load,
    through native AIO and through the thread path alike."""
    keys, _ = _one_extent(str(tmp_path), 4, 6000)
    outs = [torch.zeros(6000, dtype=torch.uint8) for _ in keys]
    missing = LoadRequest(make_key(keys[0].namespace, "never stored"), torch.zeros(6000, dtype=torch.uint8), DIGEST)
    with DiskStore(str(tmp_path), StoreConfig(io_backend=backend)) as s:
        assert s.io_backend == backend
        reasons = s.load_into([missing], lambda: [LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
    assert reasons == [Reason.MISSING] + [Reason.OK] * 4
    assert all(o.equal(make_payload(f"w{i}", 6000)) for i, o in enumerate(outs))
