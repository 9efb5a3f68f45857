"""The read path is chosen per target, not per store (issue 43): host-memory targets take native AIO on a GDS store
too, and device targets take GDS for their payloads, both as rows of the one batch pipeline. Forced here on cpu: the
store's backend is the real `GdsBackend` with its device stood in (this machine has no GPU): a set of cpu tensors
counts as device memory, and cuFile's read is a positional read of the segment file. Every other step is the store's
own."""

from __future__ import annotations

import pytest
import torch

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, StoreConfig, aio, packed
from support.read_paths import CpuGds
from support.store_helpers import DIGEST, VK, make_key, make_payload, slot_like

SIZES = [512 + 37 * i for i in range(24)]  # small records: the packed path's


@pytest.fixture(autouse=True)
def native_aio() -> None:
    ctx = aio.acquire()
    if ctx is None:
        pytest.skip("native AIO is not available on this machine: loads read with threads only")
    aio.release(ctx)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many records each load's packed path served."""
    counts: list[int] = []
    real = packed.PackedLoad.finish

    def finish(self):
        out = real(self)
        counts.append(len(out[0]))
        return out

    monkeypatch.setattr(packed.PackedLoad, "finish", finish)
    return counts


def _open(tmp_path, backend: str) -> tuple[DiskStore, list, list[torch.Tensor]]:
    root = str(tmp_path / "store")
    # device checksums on: what a GDS host writes, and what a GDS read checks on the device
    with DiskStore(root, StoreConfig(io_backend="odirect", device_checksums="on"), writer=True) as s:
        ns = s.register_namespace(VK)
        keys = [make_key(ns, f"t{i}") for i in range(len(SIZES))]
        payloads = [make_payload(f"t{i}", n) for i, n in enumerate(SIZES)]
        s.store_many([(k, p, DIGEST) for k, p in zip(keys, payloads)])
    store = DiskStore(root, StoreConfig(io_backend="odirect"))
    if backend == "gds":
        store.backend = store._ctx.backend = CpuGds(store.backend.direct_align)
    return store, keys, payloads


@pytest.mark.parametrize("backend", ["odirect", "gds"])
def test_host_targets_take_the_packed_aio_path_whatever_the_backend(tmp_path, served, backend) -> None:
    store, keys, payloads = _open(tmp_path, backend)
    try:
        outs = [slot_like(p.numel()) for p in payloads]
        reasons = store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
        assert reasons == [Reason.OK] * len(keys)
        assert all(torch.equal(o, p) for o, p in zip(outs, payloads))
        assert served == [len(keys)]  # every host target read through the packed path
        if backend == "gds":
            assert store.backend.device_reads == 0
    finally:
        store.close()


def test_device_targets_take_gds_and_host_targets_beside_them_native_aio(tmp_path, served) -> None:
    store, keys, payloads = _open(tmp_path, "gds")
    backend = store.backend
    assert isinstance(backend, CpuGds)
    try:
        outs = [slot_like(p.numel()) for p in payloads]
        on_device = set(range(0, len(keys), 3))
        backend.device.update(outs[i].data_ptr() for i in on_device)
        reasons = store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
        assert reasons == [Reason.OK] * len(keys)
        assert all(torch.equal(o, p) for o, p in zip(outs, payloads))
        assert backend.device_reads == len(on_device)  # each device target's payload read by GDS, once
        # every target a row of the batch pipeline: the host ones read through native AIO, the device ones' headers
        # too (their payloads by GDS, checked with the device checksum)
        assert served == [len(keys)]

        # A verifier's check (no targets) and a read that gets its bytes in host buffers take native AIO too.
        calls: list[int] = []
        real = aio.acquire

        def acquire():
            ctx = real()
            calls.append(ctx is not None)
            return ctx

        aio_acquire, aio.acquire = aio.acquire, acquire
        try:
            results = store.verify_many(keys, apply=False)
        finally:
            aio.acquire = aio_acquire
        assert all(r.reason is Reason.OK for r in results) and calls and all(calls)
        assert backend.device_reads == len(on_device)
    finally:
        store.close()


def test_a_device_targets_run_reads_its_header_only_through_native_aio(tmp_path, served, monkeypatch) -> None:
    """A large record into a device target: its run reads the header's aligned block through native AIO, never the
    payload (GDS reads that into the target), and the load is a row of the batch pipeline."""
    root = str(tmp_path / "store")
    payload = make_payload("big", 300_000)
    with DiskStore(root, StoreConfig(io_backend="odirect", device_checksums="on"), writer=True) as s:
        key = make_key(s.register_namespace(VK), "big")
        s.store_many([(key, payload, DIGEST)])
    asked: list[int] = []
    real_submit = aio.AioContext.submit

    def submit(self, ops):
        asked.extend(n for op in ops for _, n in op.iov)
        return real_submit(self, ops)

    monkeypatch.setattr(aio.AioContext, "submit", submit)
    with DiskStore(root, StoreConfig(io_backend="odirect")) as store:
        backend = store.backend = store._ctx.backend = CpuGds(store.backend.direct_align)
        out = slot_like(payload.numel())
        backend.device.add(out.data_ptr())
        assert store.load_into([LoadRequest(key, out, DIGEST)]) == [Reason.OK]
    assert torch.equal(out, payload) and backend.device_reads == 1 and served == [1]
    assert 0 < sum(asked) <= 2 * 4096  # the header's block (and the next, where it crosses one): no payload bytes
