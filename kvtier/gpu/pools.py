"""Preallocated pools, one per cache group: a 128-B aligned base, fixed slot stride, never moved.

On cpu a pool lives in a memfd (sparse until written), so another process can map it: the daemon
passes `PoolInfo.fd` over its unix socket and the client maps `/proc/self/fd/<fd>` with
`torch.from_file(..., shared=True)` at `base_offset`. On cuda a pool is a plain device tensor.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvtier.core.forms import CacheForm
from kvtier.core.layout import POOL_ALIGNMENT, align_up


@dataclasses.dataclass(slots=True)
class Pool:
    """One group's slots: `tensor` is the aligned uint8 view of `n_slots * slot_stride` bytes."""

    group: str
    form: CacheForm
    slot_nbytes: int
    slot_stride: int
    n_slots: int
    tensor: torch.Tensor
    base_offset: int
    fd: int | None

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def slot_view(self, slot: int) -> torch.Tensor:
        """The uint8 bytes of one slot's object (exactly `slot_nbytes`)."""
        start = slot * self.slot_stride
        return self.tensor[start : start + self.slot_nbytes]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def info(self) -> dict[str, object]:
        """What a client needs to map and address the pool."""
        return {
            "group": self.group,
            "form": self.form.value,
            "device": str(self.tensor.device),
            "address": self.address,
            "base_offset": self.base_offset,
            "slot_nbytes": self.slot_nbytes,
            "slot_stride": self.slot_stride,
            "n_slots": self.n_slots,
            "nbytes": self.n_slots * self.slot_stride,
        }


def _raw_buffer(nbytes: int, device: torch.device, name: str) -> tuple[torch.Tensor, int | None]:
    if device.type == "cpu":
        fd = os.memfd_create(f"kvtier-pool-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            raw = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        return raw, fd
    return torch.empty(nbytes, dtype=torch.uint8, device=device), None


def allocate_pool(group: str, form: CacheForm, slot_nbytes: int, budget_bytes: int, device: torch.device) -> Pool:
    """A pool of as many whole slots as `budget_bytes` holds, base aligned to 128 B."""
    stride = align_up(slot_nbytes, POOL_ALIGNMENT)
    n_slots = budget_bytes // stride
    span = n_slots * stride
    raw, fd = _raw_buffer(span + POOL_ALIGNMENT, device, group)
    offset = (-raw.data_ptr()) % POOL_ALIGNMENT
    tensor = raw[offset : offset + span]
    return Pool(group, form, slot_nbytes, stride, n_slots, tensor, offset, fd)
