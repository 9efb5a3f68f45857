"""One served profile: its `CacheManager` (pools) and what a client needs to map them."""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.profile import ModelProfile
from kvtier.wire import messages as P

if TYPE_CHECKING:  # a Runtime is built on the pool thread, which loads torch and the pools' modules first
    from kvtier.gpu import CacheManager, PoolLookup


def resolve_device(device: str) -> str:
    """`auto` is cuda where a GPU is visible, else cpu (only `auto` asks torch)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclasses.dataclass(slots=True)
class Runtime:
    """One served profile: its manager (pools) and what a client needs to map them."""

    name: str
    profile: ModelProfile
    manager: CacheManager
    object_bytes: np.ndarray  # per group

    def pool_infos(self) -> tuple[list[P.PoolInfo], list[int]]:
        """Pool descriptions for an attach reply, and the read-only fds that ride along with it (the slot
        generation table's, and on cpu each pool's memfd's)."""
        table, bases = self.manager.generation_table()
        fds: list[int] = [table.reader_fd]
        infos: list[P.PoolInfo] = []
        for group, pool, base in zip(self.profile.groups, self.manager.pools(), bases):
            layout = self.profile.layout(group)
            common: dict[str, Any] = dict(
                group=pool.group,
                form=pool.form.value,
                slots=pool.n_slots,
                slot_bytes=pool.slot_stride,
                object_bytes=pool.slot_nbytes,
                dtype=layout.dtype,
                shape=list(layout.shape),
                gen_fd_index=0,
                gen_offset=base,
                gen_bytes=table.nbytes,
            )
            if pool.reader_fd is not None:
                infos.append(
                    P.PoolInfo(
                        **common,
                        fd_index=len(fds),
                        pool_bytes=os.fstat(pool.reader_fd).st_size,
                        offset=pool.base_offset,
                    )
                )
                fds.append(pool.reader_fd)
            else:
                from torch.multiprocessing.reductions import reduce_tensor

                infos.append(P.PoolInfo(**common, ipc=pickle.dumps(reduce_tensor(pool.tensor))))
        return infos, fds

    def grids(self, result: PoolLookup) -> tuple[bytes, bytes]:
        """Slot and generation per (group, block), -1 where the object is not REUSE (groups in profile order,
        as the manager keeps them)."""
        slots, gens = self.manager.grid(result)
        return slots.astype("<i8", copy=False).tobytes(), gens.astype("<i8", copy=False).tobytes()
