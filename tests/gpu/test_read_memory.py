"""The memory O_DIRECT reads land in: pools and bounce buffers on huge pages where the kernel's settings allow
them (kvtier.core.hugepages; `huge_bytes` tells which pages a mapping got), and pool slots aligned so a
restore reads large objects straight into them."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from kvtier.core import hugepages
from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT, POOL_ALIGNMENT, slot_stride
from kvtier.core.profile import load_profile
from kvtier.gpu.pools import allocate_pool
from kvtier.store.io import AlignedBuffer


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


def test_a_cpu_pool_is_on_huge_pages_exactly_where_shared_memory_may_be() -> None:
    pool = allocate_pool("c4", CacheForm.COMPRESSED, 784_896, 16 << 20, torch.device("cpu"))
    try:
        huge = hugepages.huge_bytes([(pool.address, pool.tensor.numel())])
        if hugepages.setting("shmem_enabled") in ("advise", "always", "within_size", "force"):
            assert huge >= hugepages.HUGE_PAGE
        else:  # `never` or `deny`, as most distributions ship: small pages, and the pool works the same
            assert huge == 0
        assert int(pool.tensor[-1]) == 0  # taken and zeroed
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
