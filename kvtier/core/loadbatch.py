"""A recovery's load requests as columns: objects of one namespace, each bound for a slot of its group's pool.

Contract (`LoadBatch(namespace, groups, group_of, hashes, slots)`):
- It is a `Sequence[LoadRequest]`: item i is the request for object i, built when asked for: key (namespace,
  `hashes[i]`, the name and form of `groups[group_of[i]]`), out (bytes `[slots[i] * stride, + nbytes)` of that
  group's pool tensor, exactly what `Pool.slot_view` gives), layout digest (the group's). A tier that steps through
  requests works on it unchanged.
- A tier that can use the columns (the disk store's packed path) reads them directly and builds no per-object
  key or tensor: `groups`, `group_of` (int64, an index into `groups`), `hashes` (16-byte block hashes), `slots`
  (int64).
- A slice is a LoadBatch of those objects; `+` joins two LoadBatches of the same namespace and groups.
- The constructor checks what the columns must hold (a 16-byte namespace and hashes, one group and slot per
  hash, group indexes in range) and raises ValueError otherwise; what a slot points at is not checked here (a
  view past the end of its pool is as short as torch slicing makes it, as `Pool.slot_view`'s would be).

Why: a recovery builds one request per object it claims, and a `LoadRequest` (a validated key tuple, a tensor view
of the slot, the frozen record) costs several Python steps an object: a large share of a daemon's load of a short
prefix of small objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

import numpy as np

from kvtier.core.forms import CacheForm
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import NAMESPACE_BYTES

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch


def slot_bytes(pool: torch.Tensor, stride: int, nbytes: int, slot: int) -> torch.Tensor:
    """The uint8 view of one slot's object in a flat pool (`Pool.slot_view` and `TargetGroup.slot_view` both)."""
    start = slot * stride
    return pool[start : start + nbytes]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TargetGroup:
    """One cache group as a batch's objects are bound for it: its name and form (the keys'), its layout digest,
    and its pool (`tensor`: flat uint8; slot s holds bytes `[s * stride, s * stride + nbytes)`)."""

    name: str
    form: CacheForm
    layout_digest: bytes
    tensor: torch.Tensor
    stride: int
    nbytes: int

    def slot_view(self, slot: int) -> torch.Tensor:
        return slot_bytes(self.tensor, self.stride, self.nbytes, slot)

    def same_as(self, other: TargetGroup) -> bool:
        """The same group bound for the same pool (the very tensor: tensors have no equality of their own)."""
        return self.tensor is other.tensor and (self.name, self.form, self.layout_digest, self.stride, self.nbytes) == (
            other.name,
            other.form,
            other.layout_digest,
            other.stride,
            other.nbytes,
        )


class LoadBatch(Sequence[LoadRequest]):
    """Load requests as columns (the module docstring states the contract)."""

    __slots__ = ("group_of", "groups", "hashes", "namespace", "slots")

    def __init__(
        self,
        namespace: bytes,
        groups: tuple[TargetGroup, ...],
        group_of: np.ndarray,
        hashes: list[bytes],
        slots: np.ndarray,
    ) -> None:
        group_of = np.asarray(group_of, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError("the namespace must be a 16-byte digest")
        if not (len(hashes) == len(group_of) == len(slots)) or group_of.ndim != 1 or slots.ndim != 1:
            raise ValueError("a load batch needs one group and one slot per block hash")
        if hashes and set(map(len, hashes)) != {HASH_BYTES}:
            raise ValueError("block hashes must be 16-byte digests")
        if len(group_of) and (group_of.min() < 0 or group_of.max() >= len(groups)):
            raise ValueError(f"group indexes must lie in [0, {len(groups)})")
        self.namespace, self.groups, self.group_of, self.hashes, self.slots = namespace, groups, group_of, hashes, slots

    def __len__(self) -> int:
        return len(self.hashes)

    @overload
    def __getitem__(self, i: int) -> LoadRequest: ...
    @overload
    def __getitem__(self, i: slice) -> LoadBatch: ...
    def __getitem__(self, i: int | slice) -> LoadRequest | LoadBatch:
        if isinstance(i, slice):
            return LoadBatch(self.namespace, self.groups, self.group_of[i], self.hashes[i], self.slots[i])
        g = self.groups[int(self.group_of[i])]
        return LoadRequest(
            ObjectKey(self.namespace, self.hashes[i], g.name, g.form), g.slot_view(int(self.slots[i])), g.layout_digest
        )

    def __iter__(self) -> Iterator[LoadRequest]:
        return (self[i] for i in range(len(self.hashes)))

    def __add__(self, other: LoadBatch) -> LoadBatch:
        same = len(other.groups) == len(self.groups) and all(a.same_as(b) for a, b in zip(self.groups, other.groups))
        if other.namespace != self.namespace or not same:
            raise ValueError("only load batches of one namespace and the same groups join")
        return LoadBatch(
            self.namespace,
            self.groups,
            np.concatenate((self.group_of, other.group_of)),
            self.hashes + other.hashes,
            np.concatenate((self.slots, other.slots)),
        )
