"""Pools: sizing from budgets, 128-B alignment, shared memory another process can map, static topology."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.core import CacheForm
from kvtier.gpu import BudgetError, CacheManager, StaleHandle, TopologyError
from support.gpuworld import PROFILE, H, budgets, hashes_of, make, payload, prompt, state_blocks_for, write


def test_pools_sized_from_budgets_and_aligned() -> None:
    m, _, _ = make(blocks=5, state_blocks=3)
    for pool in m.pools():
        group = PROFILE.group(pool.group)
        assert pool.slot_nbytes == group.object_bytes(H)
        assert pool.slot_stride % 128 == 0 and pool.slot_stride - pool.slot_nbytes < 128
        assert pool.address % 128 == 0
        assert pool.n_slots == (5 if group.kind.value == "history" else 3)
        assert pool.tensor.numel() == pool.n_slots * pool.slot_stride
        assert _mapped_file(pool.address) == f"/memfd:kvtier-pool-{pool.group} (deleted)"  # shared memory


def _mapped_file(addr: int) -> str:
    """The file mapped at `addr` in this process, as /proc/self/maps names it."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return rest[4].strip() if len(rest) == 5 else ""
    return ""


def test_missing_or_tiny_budget_is_a_typed_error() -> None:
    with pytest.raises(BudgetError, match="no entry for form tail"):
        CacheManager(
            PROFILE, budgets_bytes={CacheForm.COMPRESSED: 1 << 20, CacheForm.SWA: 1 << 20, CacheForm.INDEXER: 1 << 20}
        )
    small = budgets(PROFILE, 4)
    small[CacheForm.SWA] = 100
    with pytest.raises(BudgetError, match="swa budget"):
        CacheManager(PROFILE, budgets_bytes=small)


CHILD = """
import errno, mmap, os, sys
fd, size, offset, nbytes = map(int, sys.argv[1:5])
ro = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
sys.stdout.write(ro[offset:offset + nbytes].hex())
# every way to a writable mapping is closed: the descriptor is read-only, and reopening the memfd
# read-write (through /proc) is refused by its F_SEAL_FUTURE_WRITE seal
for attempt in (lambda: mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR)):
    try:
        rw = attempt()
    except PermissionError:
        continue
    if isinstance(rw, int):  # reopened: the seal must still refuse a writable mapping and write(2)
        for bad, refusals in ((lambda: mmap.mmap(rw, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), ()),
                              (lambda: os.pwrite(rw, b"x", offset), (errno.EINVAL,))):  # hugetlbfs: no write(2)
            try:
                bad()
            except PermissionError:
                continue
            except OSError as exc:
                if exc.errno in refusals:
                    continue
                raise
            sys.exit("wrote the pool")
    else:
        sys.exit("mapped the pool writable")
"""


def test_another_process_maps_a_slot_read_only() -> None:
    m, _, _ = make()
    hs = hashes_of(m, prompt(3, 4))
    write(m, hs, range(4), state_at=state_blocks_for(PROFILE, 4))
    result = m.lookup(hs, owner="engine")
    handle = m.handle(result, "c4", 2)
    pool = next(p for p in m.pools() if p.group == "c4")
    size = pool.base_offset + pool.n_slots * pool.slot_stride
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(pool.reader_fd),
            str(size),
            str(pool.base_offset + handle.offset),
            str(handle.nbytes),
        ],
        pass_fds=[pool.reader_fd],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    expected = payload(PROFILE, "c4", hs[2], m.namespace)
    assert bytes.fromhex(out.stdout) == bytes(expected.tolist())
    assert torch.equal(m.read(handle, copy=True), expected)


def test_resize_only_inside_a_recompile_window() -> None:
    m, _, _ = make(blocks=4)
    hs = hashes_of(m, prompt(4, 3))
    write(m, hs, range(3), state_at=state_blocks_for(PROFILE, 3))
    before = m.pool_addresses()
    result = m.lookup(hs)
    handle = m.handle(result, "c4", 0)
    with pytest.raises(TopologyError, match="recompile_window"):
        m.resize(budgets(PROFILE, 8))
    assert m.pool_addresses() == before and m.topology_epoch == 0
    assert torch.equal(m.read(handle, copy=True), payload(PROFILE, "c4", hs[0], m.namespace))
    with m.recompile_window():
        m.resize(budgets(PROFILE, 8))
    assert m.topology_epoch == 1
    assert {p.group: p.n_slots for p in m.pools()}["c4"] == 8
    with pytest.raises(StaleHandle):
        m.read(handle)
    assert m.lookup(hs).check_vector.hit_blocks == 0  # the new pools start empty
    assert m.invariant_violations() == []
