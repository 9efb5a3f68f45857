"""The store's two read paths, for tests that must hold on both: native AIO from one thread (O_DIRECT on Linux)
and threads (where AIO is refused, or the backend is buffered). `read_path` is parametrized over them;
`scattered_reads` records the target memory (address, length) of every read either path issues."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.store import aio
from kvtier.store.io import SegmentFile


@pytest.fixture(params=["aio", "threads"])
def read_path(request, monkeypatch) -> str:
    if request.param == "threads":
        monkeypatch.setattr(aio, "acquire", lambda: None)
    else:
        ctx = aio.acquire()
        if ctx is None:
            pytest.skip("native AIO is not available on this machine")
        aio.release(ctx)
    return request.param


@pytest.fixture
def scattered_reads(read_path, monkeypatch) -> list[list[tuple[int, int]]]:
    """The (address, length) of each view of every scattered read, in the order issued (a read cut in pieces by
    AIO: one entry a piece)."""
    seen: list[list[tuple[int, int]]] = []
    real_read, real_submit = SegmentFile.preadv_into, aio.AioContext.submit

    def reading(self, views, offset):
        seen.append([(np.frombuffer(v, np.uint8).ctypes.data, len(v)) for v in views])
        return real_read(self, views, offset)

    def submitting(self, ops):
        seen.extend(list(op.iov) for op in ops)
        return real_submit(self, ops)

    monkeypatch.setattr(SegmentFile, "preadv_into", reading)
    monkeypatch.setattr(aio.AioContext, "submit", submitting)
    return seen
