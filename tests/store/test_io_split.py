"""Large scattered reads go as concurrent pieces (kvtier.store.io): same bytes, same end-of-file answer, and an
O_DIRECT read stays aligned in every piece."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvtier.store import io

MIB = 1 << 20


@pytest.fixture(params=["odirect", "buffered"])
def backend(request, tmp_path) -> io.PosixBackend:
    if request.param == "odirect":
        align = io._odirect_align(str(tmp_path), readonly=False)
        if not align:
            pytest.skip("this filesystem refuses O_DIRECT")
        return io.PosixBackend(direct=True, align=align)
    return io.PosixBackend(direct=False)


@pytest.fixture
def data_file(tmp_path) -> tuple[str, bytes]:
    data = os.urandom(13 * MIB + 3 * 4096)
    path = tmp_path / "seg"
    path.write_bytes(data)
    return str(path), data


@pytest.fixture
def preadv_calls(monkeypatch) -> list[int]:
    """The file offset of every preadv the split issues."""
    calls: list[int] = []
    real = os.preadv

    def counting(fd, views, offset):
        calls.append(offset)
        return real(fd, views, offset)

    monkeypatch.setattr(io.os, "preadv", counting)
    return calls


def _views(buf: io.AlignedBuffer, sizes: list[int]) -> list[memoryview]:
    out, at = [], 0
    for n in sizes:
        out.append(buf.mv[at : at + n])
        at += n
    return out


def test_a_large_read_is_split_and_fills_every_view(backend, data_file, preadv_calls) -> None:
    path, data = data_file
    seg = backend.open(path)
    buf = io.AlignedBuffer(16 * MIB)
    sizes = [4096, 6 * MIB + 8192, 512 * 8, 7 * MIB - 16384]  # views longer and shorter than a piece
    try:
        got = seg.preadv_into(_views(buf, sizes), 4096)
    finally:
        seg.close()
    assert got == sum(sizes)
    assert bytes(buf.mv[:got]) == data[4096 : 4096 + got]
    assert len(set(preadv_calls)) >= 5  # pieces at several offsets, not one read
    assert all(off % 4096 == 0 for off in preadv_calls)  # every piece starts aligned (O_DIRECT would refuse)


def test_end_of_file_inside_a_piece_counts_only_the_contiguous_bytes(backend, data_file) -> None:
    path, data = data_file
    seg = backend.open(path)
    buf = io.AlignedBuffer(32 * MIB)
    try:
        got = seg.preadv_into(_views(buf, [20 * MIB]), 0)
    finally:
        seg.close()
    assert got == len(data)
    assert bytes(buf.mv[:got]) == data


def test_a_small_read_is_one_preadv(backend, data_file, preadv_calls) -> None:
    path, data = data_file
    seg = backend.open(path)
    buf = io.AlignedBuffer(4 * MIB)
    try:
        assert seg.preadv_into(_views(buf, [4096, 2 * MIB]), 8192) == 2 * MIB + 4096
    finally:
        seg.close()
    assert preadv_calls == [8192]
    assert bytes(buf.mv[: 2 * MIB + 4096]) == data[8192 : 8192 + 2 * MIB + 4096]


def test_split_pieces_cover_the_views_in_order() -> None:
    views = [memoryview(bytearray(n)) for n in (4096, 3 * MIB, 512, 9 * MIB, 8192)]
    pieces = io.split_read(views, 4096)
    assert [off for _, off, _ in pieces] == [4096 + sum(n for _, _, n in pieces[:k]) for k in range(len(pieces))]
    assert sum(n for _, _, n in pieces) == sum(map(len, views))
    assert all(sum(map(len, v)) == n for v, _, n in pieces)
    assert all(n <= 2 * io.SPLIT_BYTES for _, _, n in pieces)


def test_a_forked_child_splits_reads_with_its_own_threads(data_file) -> None:
    path, data = data_file
    backend = io.PosixBackend(direct=False)
    seg = backend.open(path)
    buf = io.AlignedBuffer(16 * MIB)
    assert seg.preadv_into([buf.mv[: 12 * MIB]], 0) == 12 * MIB  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child: a split read must finish (the parent's pool threads are not here)
        ok = (
            seg.preadv_into([buf.mv[: 12 * MIB]], MIB) == 12 * MIB and bytes(buf.mv[: 12 * MIB]) == data[MIB : 13 * MIB]
        )
        os._exit(0 if ok else 1)
    seg.close()
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the child's exit (a child stuck on the parent's threads never exits)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child's split read did not finish in 60 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_a_read_of_more_views_than_iov_max_is_cut_into_pieces_of_at_most_that() -> None:
    views = [memoryview(bytearray(512)) for _ in range(3 * io._IOV_MAX + 5)]  # 1.5 MiB: under the size to cut at
    pieces = io.split_read(views, 8192)
    assert all(len(v) <= io._IOV_MAX for v, _, _ in pieces) and len(pieces) == 4
    assert [x for v, _, _ in pieces for x in v] == views
    assert [off for _, off, _ in pieces] == [8192 + sum(n for _, _, n in pieces[:k]) for k in range(len(pieces))]


def test_readable_stops_at_a_piece_in_flight_or_cut_short_and_is_final_only_with_every_piece_in() -> None:
    pieces = [([], 0, 10), ([], 10, 10), ([], 20, 10)]
    assert io.readable(pieces, [10, 10, 10]) == (30, True)
    assert io.readable(pieces, [10, -1, 10]) == (10, False)
    assert io.readable(pieces, [10, 5, -1]) == (15, False)  # cut short, but a later piece still fills its buffer
    assert io.readable(pieces, [10, 5, 0]) == (15, True)
    assert io.readable(pieces, [-1, 10, 10]) == (0, False)
