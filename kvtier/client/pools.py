"""The daemon's pools as this process sees them: mapped shared memory (cpu) or CUDA IPC tensors (cuda)."""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle

import torch

from kvtier.wire.messages import PoolInfo


@dataclasses.dataclass(slots=True)
class MappedPool:
    """One group's pool: `slots` rows of `slot_bytes`, the first `object_bytes` of each row being one object."""

    info: PoolInfo
    rows: torch.Tensor  # uint8 (slots, slot_bytes), the daemon's memory
    _mmap: mmap.mmap | None = None

    def object_bytes(self, slot: int) -> torch.Tensor:
        """The raw bytes of the object in `slot` (a view, no copy)."""
        if not 0 <= slot < self.info.slots:
            raise IndexError(f"slot {slot} outside pool {self.info.group} of {self.info.slots} slots")
        return self.rows[slot, : self.info.object_bytes]

    def object_view(self, slot: int) -> torch.Tensor:
        """The object in `slot` with its layout's dtype and shape (a view, no copy)."""
        raw = self.object_bytes(slot)
        dtype = getattr(torch, self.info.dtype) if self.info.dtype != "packed" else torch.uint8
        return raw.view(dtype).view(self.info.shape) if dtype is not torch.uint8 else raw.view(self.info.shape)

    def close(self) -> None:
        self.rows = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a caller still holds a view: the mapping goes when that view does
                pass
            self._mmap = None


def map_pool(info: PoolInfo, fds: list[int]) -> MappedPool:
    """Map a pool from the attach reply: a shared-memory fd (cpu) or a pickled CUDA IPC handle (cuda)."""
    if info.ipc:
        rebuild, args = pickle.loads(info.ipc)  # the daemon's own torch.multiprocessing.reductions.reduce_tensor
        flat = rebuild(*args).view(torch.uint8).reshape(-1)
        return MappedPool(
            info, flat[info.offset : info.offset + info.slots * info.slot_bytes].view(info.slots, info.slot_bytes)
        )
    fd = fds[info.fd_index]
    size = info.pool_bytes or os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    return MappedPool(
        info, flat[info.offset : info.offset + info.slots * info.slot_bytes].view(info.slots, info.slot_bytes), mm
    )
