"""The offload path of one CacheManager: reserve a slot, fill it, seal it whole (or drop it)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.forms import Reason
from kvtier.core.tier import ObjectKey
from kvtier.gpu.context import ManagerContext
from kvtier.gpu.errors import AdmissionRefused, PartialBlock, StaleHandle
from kvtier.gpu.leases import WriteHandle
from kvtier.gpu.states import BlockState
from kvtier.gpu.table import IN_FLIGHT


class Writes:
    """Write handles of the manager's slots; runs under the context's lock."""

    def __init__(self, context: ManagerContext) -> None:
        self._c = context

    def begin(self, key: ObjectKey, layout_digest: bytes, owner: Hashable) -> WriteHandle | None:
        """See `CacheManager.begin_write`."""
        c = self._c
        g = c.check_key(key)
        if layout_digest != c.digests[g]:
            raise LayoutError(
                f"{key.group}: the writer's layout digest {layout_digest.hex()} is not the live kernels' "
                f"{c.digests[g].hex()}; write with the current kernel ABI and layout"
            )
        with c.lock:
            t = c.table
            now = c.clock()
            c.expire(now)
            row = t.index.get(key.block_hash)
            if row is not None:
                verdict = t.e_verdict[g, row]
                if verdict in (Reason.OK, Reason.PARTIAL_BLOCK, IN_FLIGHT):
                    return None
                old = int(t.e_slot[g, row])
                if old >= 0 and not c.space.evict_unpinned(old):
                    raise AdmissionRefused(f"{key.group}: a stale copy of this block is pinned; unpin it first")
            slot = c.space.allocate(g, c.ns_id)
            try:
                row = t.row(key.block_hash)  # after allocating: an eviction may have dropped the old row
            except AdmissionRefused:
                c.space.unallocate(g, slot)
                raise
            t.move(slot, BlockState.WRITING)
            gen = t.bind(slot, row, Reason.PARTIAL_BLOCK, c.ns_id)
            local = c.space.local(g, slot)
            pool = c.pools[g]
            handle = WriteHandle(c.book.next_id(), key, local, gen, local * pool.slot_stride, pool.slot_nbytes, owner)
            c.book.add_write(handle, now + c.ttl)
            return handle

    def seal(self, handle: WriteHandle, written_bytes: int) -> None:
        """See `CacheManager.seal`."""
        c = self._c
        g = c.group_ix[handle.key.group]
        with c.lock:
            t = c.table
            slot = int(t.base[g]) + handle.slot
            live = handle.write_id in c.book.writes
            if not live or t.s_gen[slot] != handle.generation or t.s_state[slot] != BlockState.WRITING:
                raise StaleHandle("the write handle expired or was aborted; begin the write again")
            if written_bytes != handle.nbytes:
                c.abort_write(handle)
                raise PartialBlock(
                    f"{handle.key.group}: sealed after {written_bytes} of {handle.nbytes} bytes; a block is sealed "
                    "only when whole: begin the write again and fill all of it"
                )
            c.book.drop(handle.write_id)
            t.seal(slot, c.ns_id)
            c.counters.event("writes_sealed", c.gform[g])

    def write_block(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes, owner: Hashable) -> bool:
        """See `CacheManager.write_block`."""
        c = self._c
        data = payload.detach().contiguous().reshape(-1).view(torch.uint8)
        with c.lock:
            handle = self.begin(key, layout_digest, owner)
            if handle is None:
                return False
            if data.numel() == handle.nbytes:
                c.pools[c.group_ix[key.group]].slot_view(handle.slot).copy_(data)
            self.seal(handle, data.numel())
            return True
