"""Leases (TOCTOU): what a lookup or a write hands out, and the book that expires the leaked ones."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Hashable

import numpy as np

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey


@dataclasses.dataclass(frozen=True, slots=True)
class Handle:
    """One leased object: `(slot, generation, form, namespace)` plus where its bytes are in the group's pool."""

    lease_id: int
    group: str
    block: int
    slot: int
    generation: int
    form: CacheForm
    namespace: bytes
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class WriteHandle:
    """A slot reserved for one object being written: fill `nbytes` at `offset` of the group's pool, then seal."""

    write_id: int
    key: ObjectKey
    slot: int
    generation: int
    offset: int
    nbytes: int
    owner: Hashable


@dataclasses.dataclass(slots=True, eq=False)
class LeaseSet:
    """Everything one lookup holds: the history objects of its hit rows and the state objects of its window.

    `gens[g, b]` is the generation of group g's object for block b seen at lookup (blocks below the
    hit); a read through a handle is good only while the slot still carries it. `routes`/`reasons`
    are the per-group findings before the intersection, kept so a recovery can rebuild the vector.
    """

    lease_id: int
    owner: Hashable
    namespace: bytes
    expires_at: float
    block_hashes: tuple[bytes, ...]
    rows: np.ndarray
    gens: np.ndarray
    routes: np.ndarray
    reasons: np.ndarray
    held_rows: np.ndarray
    held_slots: list[tuple[int, int]]  # (slot, generation) of each state object held
    reserved: int = 0
    live: bool = True


class LeaseBook:
    """Live leases and write handles by id and by owner, and one expiry heap for both (lazy deletion)."""

    __slots__ = ("_heap", "_ids", "_owners", "leases", "writes")

    def __init__(self) -> None:
        self.leases: dict[int, LeaseSet] = {}
        self.writes: dict[int, tuple[WriteHandle, float]] = {}
        self._owners: dict[Hashable, set[int]] = {}
        self._heap: list[tuple[float, int]] = []
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def add_lease(self, lease: LeaseSet) -> None:
        self.leases[lease.lease_id] = lease
        self._own(lease.owner, lease.lease_id, lease.expires_at)

    def add_write(self, handle: WriteHandle, expires_at: float) -> None:
        self.writes[handle.write_id] = (handle, expires_at)
        self._own(handle.owner, handle.write_id, expires_at)

    def _own(self, owner: Hashable, ident: int, expires_at: float) -> None:
        self._owners.setdefault(owner, set()).add(ident)
        heapq.heappush(self._heap, (expires_at, ident))

    def drop(self, ident: int) -> None:
        """Forget a lease or write handle (idempotent)."""
        item = self.leases.pop(ident, None)
        owner = item.owner if item is not None else None
        if item is None:
            write = self.writes.pop(ident, None)
            if write is None:
                return
            owner = write[0].owner
        ids = self._owners.get(owner)
        if ids is not None:
            ids.discard(ident)
            if not ids:
                del self._owners[owner]

    def expiry(self, ident: int) -> float | None:
        """When a live lease / write handle expires (None if it is gone)."""
        lease = self.leases.get(ident)
        if lease is not None:
            return lease.expires_at
        write = self.writes.get(ident)
        return write[1] if write is not None else None

    def renew(self, owner: Hashable, expires_at: float) -> int:
        """Push back the expiry of every lease and write handle of `owner` (a client that is still alive);
        returns how many it holds. The old heap entries stay and are skipped when they come due."""
        ids = self._owners.get(owner, ())
        for ident in ids:
            lease = self.leases.get(ident)
            if lease is not None:
                lease.expires_at = max(lease.expires_at, expires_at)
            else:
                self.writes[ident] = (self.writes[ident][0], max(self.writes[ident][1], expires_at))
            heapq.heappush(self._heap, (expires_at, ident))
        return len(ids)

    def due(self, now: float) -> list[int]:
        """Ids of live leases / write handles whose expiry is at or before `now` (renewals respected)."""
        out: dict[int, None] = {}  # ordered, and a renewed id has several heap entries
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, ident = heapq.heappop(heap)
            expiry = self.expiry(ident)
            if expiry is not None and expiry <= now:
                out[ident] = None
        return list(out)

    def of_owner(self, owner: Hashable) -> list[int]:
        return sorted(self._owners.get(owner, ()))

    def clear(self) -> None:
        self.leases.clear()
        self.writes.clear()
        self._owners.clear()
        self._heap.clear()
