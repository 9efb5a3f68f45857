"""The read path is chosen per target, not per store (issue 43): host-memory targets take native AIO (the packed
path first) on a GDS store too, and device targets take GDS. Forced here on cpu: the store's backend is the real
`GdsBackend` with its device stood in (this machine has no GPU): a set of cpu tensors counts as device memory,
and cuFile's read is a positional read of the segment file. Every other step is the store's own."""

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
        pytest.skip("native AIO is not available on this machine: loads take the general path only")
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
        assert backend.device_reads == len(on_device)  # each device target read by GDS, once
        assert served == [len(keys) - len(on_device)]  # the host targets beside them: the packed path

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
