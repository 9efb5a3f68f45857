"""Load targets for the benchmarks' in-process loads, in the memory the daemon's pool slots are.

One pool made by `kvtier.gpu.pools.allocate_pool` (on cpu a memfd whose pages are taken when it is made, huge
pages where the kernel allows them for shared memory, moved onto them here where the daemon would move its pools
after start; on cuda a device tensor), carved as the daemon's slots are:
the store reads large payloads straight into such a view, with no bounce copy, in requests as large as the
daemon's pools allow.
A benchmark that gave the store ordinary tensors would measure a caller's memory, not kvtier's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.forms import CacheForm
from kvtier.core.layout import slot_stride
from kvtier.gpu.pools import allocate_pool

_CPU = torch.device("cpu")


def slot_targets(sizes: Sequence[int], device: torch.device = _CPU) -> list[torch.Tensor]:
    """One zeroed view per size, carved in order from one pool on `device`, each aligned as a daemon's slot of that
    size is (`slot_stride`: 4096 B from 4 KiB on)."""
    return slot_pool(sizes, device)[0]


def slot_pool(sizes: Sequence[int], device: torch.device = _CPU) -> tuple[list[torch.Tensor], str]:
    """`slot_targets`' views and how their pool got its pages (`Pool.pages`: thp, hugetlb, collapse, small, device)."""
    strides = [slot_stride(n) for n in sizes]
    total = sum(strides)
    pool = allocate_pool("bench-targets", CacheForm.COMPRESSED, total, slot_stride(total), device)
    if pool.move is not None:  # on huge pages before anything is timed, as a daemon's pools are once moved
        pool.move.run()
    memory = pool.tensor
    pool.close()  # the mapping outlives the descriptors
    views, at = [], 0
    for n, stride in zip(sizes, strides):
        views.append(memory[at : at + n])
        at += stride
    return views, pool.pages
