"""The submit strategies (kvtier/store/submit.py) against a real file: each read lands in its own memory with the
bytes it read, a short read means end of file, a failed read is raised only once nothing is in flight, and the
store picks the strategy its segments and kernel allow."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.store import DiskStore, StoreConfig, aio
from kvtier.store.io import AlignedBuffer, PosixBackend, SegmentFile
from kvtier.store.submit import ThreadReads, close_reads, open_reads


@pytest.fixture
def segment(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 64 * 4096, dtype=np.uint8).tobytes()
    path = tmp_path / "seg"
    path.write_bytes(data)
    seg = PosixBackend(direct=False).open(str(path))
    yield seg, data
    seg.close()


def _ops(seg: SegmentFile, buf: AlignedBuffer, spans: list[tuple[int, int]]) -> list[aio.ReadOp]:
    """One read per (file offset, length), each into its own part of `buf`, two views each (a scattered read)."""
    ops, at = [], 0
    for k, (offset, n) in enumerate(spans):
        half = n // 2
        ops.append(aio.ReadOp(seg, [(buf.addr + at, half), (buf.addr + at + half, n - half)], offset, k))
        at += n
    return ops


def test_thread_reads_land_each_read_in_its_memory(segment) -> None:
    seg, data = segment
    spans = [(o * 4096, 4096 * (1 + o % 3)) for o in range(0, 60, 4)] + [(len(data) - 1000, 4096)]  # last: past EOF
    buf = AlignedBuffer(sum(n for _, n in spans))
    with ThreadPoolExecutor(3) as pool:
        reads = ThreadReads(pool, 3)
        reads.submit(_ops(seg, buf, spans))
        assert reads.pending == len(spans) and reads.pending_bytes == sum(n for _, n in spans)
        got: dict[int, int] = {}
        while reads.pending:
            got.update((op.tag, n) for op, n in reads.complete())
        assert reads.pending_bytes == 0 and reads.complete() == []
    at = 0
    for k, (offset, n) in enumerate(spans):
        want = data[offset : offset + n]
        assert got[k] == len(want)  # fewer than asked only at end of file
        assert bytes(buf.mv[at : at + len(want)]) == want
        at += n


def test_a_failed_read_is_raised_once_nothing_is_in_flight(segment, tmp_path) -> None:
    seg, _ = segment
    gone = PosixBackend(direct=False).open(str(tmp_path / "seg"))
    gone.close()  # its fd is -1: the read fails with EBADF
    buf = AlignedBuffer(16 * 4096)
    ops = _ops(seg, buf, [(k * 4096, 4096) for k in range(8)])
    ops.insert(3, aio.ReadOp(gone, [(buf.addr, 4096)], 0, "bad"))
    with ThreadPoolExecutor(2) as pool:
        reads = ThreadReads(pool, 2)
        reads.submit(ops)
        with pytest.raises(OSError):
            while reads.pending:
                reads.complete()  # (the reads returned with the failure are forgotten with it: the load fails)
        assert reads.pending == 0 and reads.pending_bytes == 0  # raised only once every other read came back
        reads.drain()
        assert reads.complete() == []


def test_the_store_picks_native_aio_for_o_direct_segments_and_threads_otherwise(tmp_path, monkeypatch) -> None:
    with DiskStore(str(tmp_path / "b"), StoreConfig(io_backend="buffered"), writer=True) as s:
        reads = open_reads(s._ctx)
        assert isinstance(reads, ThreadReads)  # io_submit on a buffered file would read synchronously
        close_reads(reads)
    native = aio.acquire()
    if native is None:
        pytest.skip("native AIO is not available on this machine")
    aio.release(native)
    with DiskStore(str(tmp_path / "d"), StoreConfig(io_backend="odirect"), writer=True) as s:
        reads = open_reads(s._ctx)
        assert isinstance(reads, aio.AioContext)
        close_reads(reads)
        monkeypatch.setattr(aio, "acquire", lambda: None)  # the kernel refuses a context
        assert isinstance(open_reads(s._ctx), ThreadReads)
