"""The memory O_DIRECT reads land in: pools and bounce buffers on huge pages where the kernel's settings allow
them (kvtier.core.hugepages; `huge_bytes` tells which pages a mapping got), and pool slots aligned so a
restore reads large objects straight into them."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.core import hugepages
from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT, POOL_ALIGNMENT, slot_stride
from kvtier.core.profile import load_profile
from kvtier.gpu.pools import allocate_pool
from kvtier.store.io import AlignedBuffer

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def test_a_mapping_without_huge_pages_counts_none() -> None:
    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)
    assert hugepages.huge_bytes([(t.data_ptr(), t.numel())]) == 0
    del t
    m.close()


@pytest.mark.skipif(
    hugepages.setting("enabled") not in ("madvise", "always"), reason="this kernel gives no anonymous THP"
)
def test_a_large_bounce_buffer_is_on_huge_pages() -> None:
    buf = AlignedBuffer(8 << 20)
    buf.tensor.fill_(1)  # pages are chosen when faulted in
    assert hugepages.huge_bytes([(buf.addr, buf.capacity)]) >= hugepages.HUGE_PAGE


def test_a_cpu_pool_gets_the_pages_the_kernel_gives_shared_memory() -> None:
    """The pool takes what `shared_pages` decides from the kernel's settings now, and `huge_bytes` shows it got
    them: THP where shmem_enabled grants them, hugetlb where reserved pages cover it, small pages moved onto huge
    ones by its move where MADV_COLLAPSE does that (a stock host on Linux 6.1+), else none."""
    plan = hugepages.shared_pages(hugepages.read_host(), [16 << 20])
    pool = allocate_pool("c4", CacheForm.COMPRESSED, 784_896, 16 << 20, torch.device("cpu"))
    try:
        huge = hugepages.huge_bytes([(pool.address, pool.tensor.numel())])
        assert pool.pages == plan.how.value
        assert (pool.move is not None) == (plan.how is hugepages.SharedPages.COLLAPSE)
        if plan.how is hugepages.SharedPages.SMALL:  # `never` or `deny`, no hugetlb, no MADV_COLLAPSE
            assert huge == 0
        elif plan.how is hugepages.SharedPages.COLLAPSE:
            assert pool.move is not None and huge == 0  # small pages until moved
            pool.move.run()
            assert pool.move.left == 0 and pool.move.moved > 0
            assert hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == pool.move.moved
        elif plan.how is hugepages.SharedPages.HUGETLB:
            assert huge >= pool.tensor.numel()
        else:
            assert huge >= hugepages.HUGE_PAGE
        assert int(pool.tensor[-1]) == 0  # taken and zeroed
    finally:
        pool.close()


def test_a_pool_told_of_hugetlb_pages_that_are_gone_takes_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between reading /proc/meminfo and mapping, another process may take the free hugetlb pages: the mapping
    is refused, and the pool is made on small pages, never an error."""
    real = hugepages.read_host()
    if real.hugetlb_free:
        pytest.skip("this host has hugetlb pages free: the mapping would succeed")
    monkeypatch.setattr(hugepages, "read_host", lambda: hugepages.HostPages("never", 1 << 20, hugepages.HUGE_PAGE))
    pool = allocate_pool("c4", CacheForm.COMPRESSED, 784_896, 8 << 20, torch.device("cpu"))
    try:
        assert pool.pages == "small"
        if real.shmem_enabled not in hugepages.SHMEM_GRANTS:
            assert hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == 0
        pool.tensor[-1] = 3
        assert int(pool.tensor[-1]) == 3
    finally:
        pool.close()


@contextlib.contextmanager
def _reserved(pages: int) -> Iterator[None]:
    """`pages` more hugetlb pages reserved inside the block (root), the host's number put back after: the pages a
    pool took stay its own (surplus) until it is unmapped."""
    before = int(NR_HUGEPAGES.read_text())
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    in_use = next(int(line.split()[1]) for line in meminfo if line.startswith("HugePages_Total"))
    try:  # above every page that exists now (surplus ones in use included), so `pages` of them are free
        NR_HUGEPAGES.write_text(str(in_use + pages))
        if hugepages.read_host().hugetlb_free < pages:
            pytest.skip("the kernel could not reserve the pages (memory too fragmented)")
        yield
    finally:
        NR_HUGEPAGES.write_text(str(before))


@pytest.mark.alone  # vm.nr_hugepages is the host's: a test on another worker reserving or giving back pages races it
@pytest.mark.skipif(os.geteuid() != 0, reason="reserving hugetlb pages (vm.nr_hugepages) needs root")
def test_where_shmem_thp_is_refused_reserved_hugetlb_pages_make_a_sealed_shareable_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """shmem_enabled = never (planted: this host's setting may differ), 8 hugetlb pages reserved for the test: the
    pool is a MFD_HUGETLB memfd, wholly on hugetlb pages (smaps), a client maps it read-only through the fd it is
    handed and sees the daemon's bytes, and no one can map it writable again (the seal holds for hugetlb too)."""
    real = hugepages.read_host
    monkeypatch.setattr(hugepages, "read_host", lambda: dataclasses.replace(real(), shmem_enabled="never"))
    with _reserved(8):
        pool = allocate_pool("c4", CacheForm.COMPRESSED, 784_896, 8 << 20, torch.device("cpu"))
    try:
        assert pool.pages == "hugetlb"
        size = os.fstat(pool.reader_fd).st_size
        assert size % hugepages.HUGE_PAGE == 0 and size >= pool.tensor.numel()
        assert hugepages.huge_bytes([(pool.address, pool.tensor.numel())]) == size
        pool.slot_view(3)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        seen = mmap.mmap(pool.reader_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        at = pool.base_offset + 3 * pool.slot_stride
        assert seen[at : at + 4] == bytes([1, 2, 3, 4])
        seen.close()
        with pytest.raises(PermissionError):
            mmap.mmap(pool.reader_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        again = os.open(f"/proc/self/fd/{pool.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(again, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):  # hugetlbfs has no write(2): EINVAL
                os.pwrite(again, b"x", at)
            assert bytes(pool.slot_view(3)[:4].tolist()) == bytes([1, 2, 3, 4])
        finally:
            os.close(again)
    finally:
        pool.close()


def test_every_large_slot_of_a_dsv4_pool_starts_where_a_direct_read_can_fill_it() -> None:
    """Slots of 4 KiB objects or more start 4096-aligned (as their payloads lie on disk), so a restore reads each
    straight into its slot; at 128 B alone half the indexer slots (177,408 B) were 256 B off a 512 B boundary."""
    p = load_profile("deepseek-v4-flash")
    h = p.hash_block_tokens
    for g in p.groups:
        n = g.object_bytes(h)
        pool = allocate_pool(g.name, g.form, n, 5 * slot_stride(n), torch.device("cpu"))
        try:
            assert pool.n_slots == 5
            for slot in range(pool.n_slots):
                address = pool.slot_view(slot).data_ptr()
                assert address % (DISK_ALIGNMENT if n >= DISK_ALIGNMENT else POOL_ALIGNMENT) == 0, (g.name, slot)
        finally:
            pool.close()


def test_a_kernel_without_populate_still_gets_a_whole_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.14 madvise refuses MADV_POPULATE_WRITE (EINVAL): the pool takes its pages with fallocate."""
    monkeypatch.setattr(hugepages, "_MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows: EINVAL
    assert hugepages.populate(AlignedBuffer(1 << 16).addr, 1 << 16) is False
    pool = allocate_pool("c4", CacheForm.COMPRESSED, 784_896, 4 << 20, torch.device("cpu"))
    try:
        fd_blocks = os.fstat(pool.fd).st_blocks * 512
        assert fd_blocks >= pool.tensor.numel()  # every page taken now, not at first touch
        assert int(pool.tensor.sum()) == 0
    finally:
        pool.close()
