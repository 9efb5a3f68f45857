"""The daemon's pools as this process sees them: read-only shared memory (cpu) or CUDA IPC tensors (cuda),
and the slot generation table (host shared memory, read-only) that reads re-validate against."""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import warnings

import numpy as np
import torch

from kvtier.wire.messages import PoolInfo


@dataclasses.dataclass(slots=True)
class MappedPool:
    """One group's pool: `slots` rows of `slot_bytes`, the first `object_bytes` of each row being one object."""

    info: PoolInfo
    rows: torch.Tensor  # uint8 (slots, slot_bytes), the daemon's memory (read-only on cpu)
    gens: np.ndarray  # int64 per slot of this pool: the daemon's generation table, read-only
    _mmap: mmap.mmap | None = None

    @property
    def writable(self) -> bool:
        """Whether this process may write reserved slots in place (CUDA IPC); on cpu offloads are staged."""
        return self._mmap is None

    def generation(self, slot: int) -> int:
        """The slot's generation now (it moves before the slot is reused: a lease's reads are good while
        it equals the lease's)."""
        return int(self.gens[slot])

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


def map_generations(info: PoolInfo, fds: list[int]) -> np.ndarray:
    """The whole slot generation table of the attach reply, mapped read-only (shared by its pools)."""
    fd = fds[info.gen_fd_index]
    size = info.gen_bytes or os.fstat(fd).st_size
    return np.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), dtype=np.int64)


def map_pool(info: PoolInfo, fds: list[int], gens: np.ndarray) -> MappedPool:
    """Map a pool from the attach reply: a read-only shared-memory fd (cpu) or a pickled CUDA IPC handle (cuda)."""
    mine = gens[info.gen_offset : info.gen_offset + info.slots]
    if info.ipc:
        rebuild, args = pickle.loads(info.ipc)  # the daemon's own torch.multiprocessing.reductions.reduce_tensor
        flat = rebuild(*args).view(torch.uint8).reshape(-1)
        return MappedPool(
            info, flat[info.offset : info.offset + info.slots * info.slot_bytes].view(info.slots, info.slot_bytes), mine
        )
    fd = fds[info.fd_index]
    size = info.pool_bytes or os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: it is not meant to be
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    return MappedPool(
        info, flat[info.offset : info.offset + info.slots * info.slot_bytes].view(info.slots, info.slot_bytes), mine, mm
    )
