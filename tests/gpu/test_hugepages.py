"""kvtier.core.hugepages on this kernel: the pools and bounce buffers that O_DIRECT reads land in are on huge
pages where the kernel's settings allow them, and `huge_bytes` tells which pages a mapping got."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from kvtier.core import hugepages
from kvtier.core.forms import CacheForm
from kvtier.gpu.pools import allocate_pool
from kvtier.store.io import AlignedBuffer

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _setting(name: str) -> str:
    """The bracketed choice of a THP setting ('' where the kernel has no THP)."""
    path = THP / name
    if not path.exists():
        return ""
    text = path.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def test_a_mapping_without_huge_pages_counts_none() -> None:
    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)
    assert hugepages.huge_bytes(t.data_ptr(), t.numel()) == 0
    del t
    m.close()


@pytest.mark.skipif(_setting("enabled") not in ("madvise", "always"), reason="this kernel gives no anonymous THP")
def test_a_large_bounce_buffer_is_on_huge_pages() -> None:
    buf = AlignedBuffer(8 << 20)
    buf.tensor.fill_(1)  # pages are chosen when faulted in
    assert hugepages.huge_bytes(buf.addr, buf.capacity) >= hugepages.HUGE_PAGE


def test_a_cpu_pool_is_on_huge_pages_exactly_where_shared_memory_may_be() -> None:
    pool = allocate_pool("c4", CacheForm.COMPRESSED, 784_896, 16 << 20, torch.device("cpu"))
    try:
        huge = hugepages.huge_bytes(pool.address, pool.tensor.numel())
        if _setting("shmem_enabled") in ("advise", "always", "within_size", "force"):
            assert huge >= hugepages.HUGE_PAGE
        else:  # `never` or `deny`, as most distributions ship: small pages, and the pool works the same
            assert huge == 0
        assert int(pool.tensor[-1]) == 0  # taken and zeroed
    finally:
        pool.close()
