"""The store's two read paths, for tests that must hold on both: native AIO from one thread (O_DIRECT on Linux)
and threads (where AIO is refused, or the backend is buffered). `read_path` is parametrized over them;
`scattered_reads` records the target memory (address, length) of every read either path issues. `CpuGds` stands a
GDS backend in on a machine without a GPU: a set of cpu tensors counts as device memory. `replace_entry` rewrites a
record's index entry (resealed, so it parses) for the fault cases a reader must name from the index or the header."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore, IndexEntry, aio, encode_key
from kvtier.store.io import GdsBackend, PosixBackend, SegmentFile


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


class CpuGds(GdsBackend):
    """GdsBackend's decisions with the device stood in: no kvikio import, cuFile's read replaced."""

    def __init__(self, align: int) -> None:
        PosixBackend.__init__(self, direct=True, align=align)
        self.name = "gds"
        self.device: set[int] = set()  # data_ptr()s of the tensors standing for device memory
        self.device_reads = 0

    def device_io(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self.device

    def read_device(self, seg: SegmentFile, out: torch.Tensor, offset: int) -> int:
        self.device_reads += 1
        fd = os.open(seg.path, os.O_RDONLY)  # buffered: cuFile takes any offset
        try:
            data = os.pread(fd, out.numel(), offset)
        finally:
            os.close(fd)
        out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return len(data)


def replace_entry(store: DiskStore, key: ObjectKey, **fields) -> None:
    """The key's index entry with `fields` replaced, committed (a writer store)."""
    raw = encode_key(key)

    def put(txn) -> None:
        entry = IndexEntry.unpack(txn.get(raw, db=store.index.obj))
        txn.put(raw, dataclasses.replace(entry, **fields).pack(), db=store.index.obj)

    store.index.update(put)
