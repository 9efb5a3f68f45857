"""The AIO wave scheduler (kvtier.store.aio_runs) as a state machine over a real O_DIRECT file: for any runs, window,
piece, queue depth, group and bounce budget, with or without runs handed over later (`more`), every job is checked
exactly once, in file order within its run,
with exactly the file's bytes; records past end of file come back as cut short; nothing is in flight and every
bounce buffer is back afterwards."""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core.layout import DISK_ALIGNMENT
from kvtier.store import aio
from kvtier.store import aio_runs as waves
from kvtier.store.extent import Run, scatter
from kvtier.store.io import BufferPool, PosixBackend, readable

FILE_BYTES = 512 << 10


class CountingPool(BufferPool):
    """A real buffer pool that counts what is out."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.out = 0

    def acquire(self, nbytes):
        self.out += 1
        return super().acquire(nbytes)

    def release(self, buf) -> None:
        self.out -= 1
        super().release(buf)


@pytest.fixture(scope="module")
def segment(tmp_path_factory):
    ctx = aio.acquire()
    if ctx is None:
        pytest.skip("native AIO is not available on this machine")
    aio.release(ctx)
    path = tmp_path_factory.mktemp("waves") / "seg"
    data = random.Random(11).randbytes(FILE_BYTES)
    path.write_bytes(data)
    f = PosixBackend(direct=True).open(str(path))
    yield f, data
    f.close()


@st.composite
def loads(draw):
    """Runs of records (offset, length, job id), some reaching past end of file, and the scheduler's knobs."""
    runs, job, at = [], 0, 0
    for _ in range(draw(st.integers(1, 12))):
        at += draw(st.integers(0, 8)) * DISK_ALIGNMENT  # a gap before the run
        start, jobs = at, []
        for _ in range(draw(st.integers(1, 6))):
            length = draw(st.integers(1, 40_000))
            jobs.append((at, length, job))
            job += 1
            at += length + draw(st.integers(0, 300))
        end = -(-at // DISK_ALIGNMENT) * DISK_ALIGNMENT
        runs.append(Run(0, start, end, jobs))
        at = end
    knobs = {
        "AIO_PIECE_BYTES": draw(st.sampled_from([4096, 8192, 16384, 65536])),
        "AIO_WINDOW_BYTES": draw(st.sampled_from([4096, 16384, 65536, 1 << 20])),
        "AIO_GROUP": draw(st.integers(1, 4)),
        "AIO_BOUNCE_BYTES": draw(st.sampled_from([1, 32768, 1 << 20])),
    }
    split = draw(st.none() | st.integers(0, len(runs)))  # the runs `more` hands over, after those of the start
    return runs, knobs, draw(st.integers(1, 8)), split


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(load=loads())
def test_every_job_is_checked_once_with_the_files_bytes(segment, load) -> None:
    f, data = segment
    runs, knobs, depth, split = load
    pool = CountingPool()
    checked: list[tuple[int, int, bool, bool]] = []  # (run number, job id, complete, bytes equal)
    numbers = {id(r): k for k, r in enumerate(runs)}

    def plan(run):
        return run, f, scatter(run, [(0, 0)] * len(run.jobs))

    def place(run, seg, plan_, share, base):
        return waves.RunRead(run, seg, plan_, share, base, [share.buf.mv[base : base + plan_.bounce_bytes]])

    def check(rr, got, first, stop):
        out = []
        for (offset, length, job), where in zip(rr.run.jobs[first:stop], rr.plan.where[first:stop]):
            complete = got >= offset + length
            at = rr.base + where
            same = complete and rr.share.buf.mv[at : at + length] == data[offset : offset + length]
            checked.append((numbers[id(rr.run)], job, complete, same))
            out.append(job)
        return out

    ctx = aio.acquire()
    asked: list[int] = []  # reads in flight when `more` was called

    def more():
        asked.append(ctx.pending)
        return runs[split:]

    try:
        with mock.patch.multiple(waves, **knobs), mock.patch.object(aio, "DEPTH", depth):
            if split is None:
                results = waves.WaveRead(ctx, runs, pool, plan, place, check).run()
            else:
                results = waves.WaveRead(ctx, runs[:split], pool, plan, place, check, more=more).run()
        assert ctx.pending == 0
    finally:
        aio.release(ctx)
    jobs = [j for r in runs for _, _, j in r.jobs]
    assert sorted(results) == jobs  # every job once
    for k, run in enumerate(runs):  # in file order within its run
        assert [j for n, j, _, _ in checked if n == k] == [j for _, _, j in run.jobs]
    for offset, length, job in (j for r in runs for j in r.jobs):
        complete, same = next((c, s) for _, jb, c, s in checked if jb == job)
        assert complete == (offset + length <= FILE_BYTES)
        assert same == complete
    assert pool.out == 0
    if split is not None:  # asked once; after the first runs' reads went out, if there were any
        assert len(asked) == 1 and (asked[0] > 0 or split == 0)


def test_readable_stops_at_a_piece_in_flight_or_cut_short_and_is_final_only_with_every_piece_in() -> None:
    pieces = [([], 0, 10), ([], 10, 10), ([], 20, 10)]
    assert readable(pieces, [10, 10, 10]) == (30, True)
    assert readable(pieces, [10, -1, 10]) == (10, False)
    assert readable(pieces, [10, 5, -1]) == (15, False)  # cut short, but a later piece still fills its buffer
    assert readable(pieces, [10, 5, 0]) == (15, True)
    assert readable(pieces, [-1, 10, 10]) == (0, False)
