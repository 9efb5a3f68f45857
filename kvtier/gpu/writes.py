"""The offload path of one CacheManager: reserve a slot, fill it, seal it whole (or drop it)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from kvtier.core.errors import LayoutError
from kvtier.core.forms import Reason
from kvtier.core.tier import ObjectKey
from kvtier.gpu.errors import AdmissionRefused, PartialBlock, StaleHandle
from kvtier.gpu.leases import WriteHandle
from kvtier.gpu.states import BlockState
from kvtier.gpu.table import IN_FLIGHT

if TYPE_CHECKING:
    from kvtier.gpu.manager import CacheManager


class Writes:
    """Write handles of the manager's slots; runs under the manager's lock."""

    def __init__(self, manager: CacheManager) -> None:
        self._m = manager

    def begin(self, key: ObjectKey, layout_digest: bytes, owner: Hashable) -> WriteHandle | None:
        """See `CacheManager.begin_write`."""
        m = self._m
        g = m._check_key(key)
        if layout_digest != m._digests[g]:
            raise LayoutError(
                f"{key.group}: the writer's layout digest {layout_digest.hex()} is not the live kernels' "
                f"{m._digests[g].hex()}; write with the current kernel ABI and layout"
            )
        with m._lock:
            t = m._table
            now = m._clock()
            m._expire(now)
            row = t.index.get(key.block_hash)
            if row is not None:
                verdict = t.e_verdict[g, row]
                if verdict in (Reason.OK, Reason.PARTIAL_BLOCK, IN_FLIGHT):
                    return None
                old = int(t.e_slot[g, row])
                if old >= 0 and not m._space.evict_unpinned(old):
                    raise AdmissionRefused(f"{key.group}: a stale copy of this block is pinned; unpin it first")
            slot = m._space.allocate(g, m._ns_id)
            try:
                row = t.row(key.block_hash)  # after allocating: an eviction may have dropped the old row
            except AdmissionRefused:
                m._space.unallocate(g, slot)
                raise
            t.move(slot, BlockState.WRITING)
            gen = t.bind(slot, row, Reason.PARTIAL_BLOCK, m._ns_id)
            local = m._space.local(g, slot)
            pool = m._pools[g]
            handle = WriteHandle(m._book.next_id(), key, local, gen, local * pool.slot_stride, pool.slot_nbytes, owner)
            m._book.add_write(handle, now + m._ttl)
            return handle

    def seal(self, handle: WriteHandle, written_bytes: int) -> None:
        """See `CacheManager.seal`."""
        m = self._m
        g = m._group_ix[handle.key.group]
        with m._lock:
            t = m._table
            slot = int(t.base[g]) + handle.slot
            live = handle.write_id in m._book.writes
            if not live or t.s_gen[slot] != handle.generation or t.s_state[slot] != BlockState.WRITING:
                raise StaleHandle("the write handle expired or was aborted; begin the write again")
            if written_bytes != handle.nbytes:
                self.abort(handle)
                raise PartialBlock(
                    f"{handle.key.group}: sealed after {written_bytes} of {handle.nbytes} bytes; a block is sealed "
                    "only when whole: begin the write again and fill all of it"
                )
            m._book.drop(handle.write_id)
            t.seal(slot, m._ns_id)
            m._counters.event("writes_sealed", m._gform[g])

    def write_block(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes, owner: Hashable) -> bool:
        """See `CacheManager.write_block`."""
        m = self._m
        data = payload.detach().contiguous().reshape(-1).view(torch.uint8)
        with m._lock:
            handle = self.begin(key, layout_digest, owner)
            if handle is None:
                return False
            if data.numel() == handle.nbytes:
                m._pools[m._group_ix[key.group]].slot_view(handle.slot).copy_(data)
            self.seal(handle, data.numel())
            return True

    def abort(self, handle: WriteHandle) -> None:
        """Forget the handle and free its slot if it is still the one being written (idempotent)."""
        m = self._m
        m._book.drop(handle.write_id)
        g = m._group_ix[handle.key.group]
        t = m._table
        slot = int(t.base[g]) + handle.slot
        if t.s_gen[slot] == handle.generation and t.s_state[slot] == BlockState.WRITING:
            t.move(slot, BlockState.FREE)
            m._space.free(slot, Reason.MISSING)
            m._counters.event("writes_aborted", m._gform[g])
