"""Load targets for the benchmarks' in-process loads, in the memory the daemon's pool slots are.

One cpu pool made by `kvtier.gpu.pools.allocate_pool` (a memfd whose pages are taken when it is made, huge
pages where the kernel allows them for shared memory), carved into page-aligned views: the store reads large
payloads straight into such a view, with no bounce copy, in requests as large as the daemon's pools allow.
A benchmark that gave the store ordinary tensors would measure a caller's memory, not kvtier's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.forms import CacheForm
from kvtier.core.layout import POOL_ALIGNMENT, align_up
from kvtier.gpu.pools import allocate_pool

PAGE = 4096


def slot_targets(sizes: Sequence[int]) -> list[torch.Tensor]:
    """One zeroed view per size, each at a page-aligned address, carved in order from one cpu pool."""
    strides = [align_up(n, PAGE) for n in sizes]
    total = max(sum(strides), PAGE)
    pool = allocate_pool("bench-targets", CacheForm.COMPRESSED, total, total + POOL_ALIGNMENT, torch.device("cpu"))
    memory = pool.tensor
    pool.close()  # the mapping outlives the descriptors
    views, at = [], 0
    for n, stride in zip(sizes, strides):
        views.append(memory[at : at + n])
        at += stride
    return views
