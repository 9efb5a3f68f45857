"""Which of a load's requests the batch pipeline (`packed.PackedLoad`) serves, as columns: request numbers, encoded
keys, namespaces, target addresses, payload lengths and layout digests, from a list of requests or a LoadBatch's
columns (no per-object key or tensor built for an object it serves).

Contract: `wanted(requests, first, device)` and `batch_wanted(batch, first, device)` return the `Wanted` columns of
the requests whose target is host memory (not one `device` claims for GDS), numbered from `first`, and the numbers of
the others; a target that is not a non-empty contiguous uint8 tensor raises StoreRequestError before anything is read.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.forms import CacheForm
from kvtier.core.loadbatch import LoadBatch, TargetGroup
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store.context import flat_uint8
from kvtier.store.errors import CorruptRecord
from kvtier.store.index import IndexEntry, RecordState, key_suffix
from kvtier.store.record import Codec

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch


@dataclasses.dataclass(slots=True)
class Wanted:
    """Requests this path may serve, as columns: request numbers, encoded keys, namespaces, target addresses,
    target sizes (the payload lengths asked for) and layout digests."""

    numbers: list[int]
    raw: list[bytes]
    namespaces: list[bytes]
    targets: list[int]
    lengths: np.ndarray
    digests: list[bytes]

    def joined(self, other: Wanted) -> Wanted:
        return Wanted(
            self.numbers + other.numbers,
            self.raw + other.raw,
            self.namespaces + other.namespaces,
            self.targets + other.targets,
            np.concatenate((self.lengths, other.lengths)),
            self.digests + other.digests,
        )

    def part(self, lo: int, hi: int) -> Wanted:
        return Wanted(
            self.numbers[lo:hi],
            self.raw[lo:hi],
            self.namespaces[lo:hi],
            self.targets[lo:hi],
            self.lengths[lo:hi],
            self.digests[lo:hi],
        )


def wanted(
    requests: Sequence[LoadRequest], first: int, device: Callable[[torch.Tensor], bool] | None
) -> tuple[Wanted, list[int]]:
    """The requests this path may serve (those with a host-memory target), and the numbers of the others;
    StoreRequestError for a target that is not a non-empty contiguous uint8 tensor."""
    outs = [r.out for r in requests]
    count = len(outs)
    n = _checked_sizes(outs)
    addr = np.fromiter(map(_data_ptr, outs), np.int64, count)
    taken = np.fromiter(map(_is_cpu, outs), bool, count)
    if device is not None:
        taken &= np.fromiter((not device(out) for out in outs), bool, count)
    mine = np.flatnonzero(taken)
    picked = requests if len(mine) == count else [requests[i] for i in mine.tolist()]
    keys = [r.key for r in picked]
    wanted = Wanted(
        (mine + first).tolist(),
        _encoded(keys),
        [k.namespace for k in keys],
        addr[taken].tolist(),
        n[taken].astype(np.uint64),
        [r.layout_digest for r in picked],
    )
    return wanted, (np.flatnonzero(~taken) + first).tolist()


def _checked_sizes(outs: list[torch.Tensor]) -> np.ndarray:
    """Each target's bytes, after checking them all as `flat_uint8` checks one (a few passes of C-level maps, not a
    Python call per target: these run per object of every load); StoreRequestError as it names the first bad one. A
    target need not be flattened: a contiguous tensor's bytes start at its data_ptr whatever its shape."""
    import torch  # loaded by whoever made the targets: a dictionary lookup here

    n = (
        np.fromiter(map(_numel, outs), np.int64, len(outs))
        if all(map(isinstance, outs, repeat(torch.Tensor)))
        else None
    )
    if (
        n is None
        or not n.all()
        or not all(map(operator.is_, map(_dtype, outs), repeat(torch.uint8)))
        or not all(map(_is_contiguous, outs))
    ):
        for out in outs:
            flat_uint8(out)
    assert n is not None  # (flat_uint8 raised for a target that is not a tensor)
    return n


# not torch.Tensor.numel: this module loads before torch does (a daemon listens first)
_numel = operator.methodcaller("numel")
_dtype = operator.attrgetter("dtype")
_is_contiguous = operator.methodcaller("is_contiguous")
_data_ptr = operator.methodcaller("data_ptr")
_is_cpu = operator.attrgetter("is_cpu")


def _encoded(keys: Sequence[ObjectKey]) -> list[bytes]:
    """`encode_key` of each key, the bytes after the block hash built once per group of the load (a form is an
    enum whose hash is a Python call: looked up per group, not per key)."""
    suffixes: dict[str, tuple[CacheForm, bytes]] = {}
    out: list[bytes] = []
    for k in keys:
        known = suffixes.get(k.group)
        if known is None or known[0] is not k.form:
            known = suffixes[k.group] = (k.form, key_suffix(k.group, k.form))
        out.append(k.namespace + k.block_hash + known[1])
    return out


def batch_wanted(
    batch: LoadBatch, first: int, device: Callable[[torch.Tensor], bool] | None
) -> tuple[Wanted, list[int]]:
    """`wanted` from a LoadBatch's columns, with no per-object key or tensor: an object is this path's where its
    group's pool is a flat contiguous uint8 tensor, its slot wholly inside the pool and in host memory. Any other
    object's request is built and its target checked as `wanted` checks it."""
    groups = batch.groups
    whole = np.array([_flat_pool(g) for g in groups], bool)
    cpu = np.array([g.tensor.is_cpu and not (device and device(g.tensor)) for g in groups], bool)
    nbytes = np.array([g.nbytes for g in groups], np.int64)
    stride = np.array([g.stride for g in groups], np.int64)
    size = np.array([g.tensor.numel() for g in groups], np.int64)
    base = np.array([g.tensor.data_ptr() for g in groups], np.int64)
    g_of, slots = batch.group_of, batch.slots
    start = slots * stride[g_of]
    inside = whole[g_of] & (slots >= 0) & (start + nbytes[g_of] <= size[g_of])
    for i in np.flatnonzero(~inside).tolist():
        flat_uint8(batch[i].out)  # raises as a list's request would; a good target is loaded as a list's
    served = inside & cpu[g_of]
    mine, rest = np.flatnonzero(served), np.flatnonzero(~served) + first
    g_mine = g_of[mine].tolist()
    suffix = [key_suffix(g.name, g.form) for g in groups]
    digest = [g.layout_digest for g in groups]
    ns, hashes = batch.namespace, batch.hashes
    wanted = Wanted(
        (mine + first).tolist(),
        [ns + hashes[i] + suffix[g] for i, g in zip(mine.tolist(), g_mine)],
        [ns] * len(mine),
        (base[g_of[mine]] + start[mine]).tolist(),
        nbytes[g_of[mine]].astype(np.uint64),
        [digest[g] for g in g_mine],
    )
    return wanted, rest.tolist()


def _flat_pool(g: TargetGroup) -> bool:
    """Whether slices of the group's pool are the flat, contiguous, non-empty uint8 targets this path needs."""
    t = g.tensor
    import torch

    return t.dtype is torch.uint8 and t.dim() == 1 and t.is_contiguous() and g.nbytes > 0 and g.stride >= g.nbytes


def servable(value: bytes | memoryview | None, ns_live: bool, digest: bytes, length: int) -> IndexEntry | None:
    """A record's index entry where a load reads it: live in a live namespace, with the request's layout digest and
    payload length, stored as is or compressed. None where there is nothing to read (no record, a corrupt index
    value, or one a lookup answers for): the caller names why from the index."""
    if not value or not ns_live:
        return None
    try:
        entry = IndexEntry.unpack(value)
    except CorruptRecord:
        return None
    if (
        entry.state is RecordState.LIVE
        and entry.layout_digest == digest
        and entry.payload_len == length
        and (entry.codec is Codec.ZSTD or entry.stored_len == entry.payload_len)
    ):
        return entry
    return None
