"""The one small interface every tier below the GPU pool implements (the disk store first)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.versions import NAMESPACE_BYTES

if TYPE_CHECKING:  # a daemon answers lookups before torch is loaded: the tensors here are annotations only
    import torch


class _KeyFields(NamedTuple):
    namespace: bytes
    block_hash: bytes
    group: str
    form: CacheForm


class ObjectKey(_KeyFields):
    """Identity of one cache object: namespace, chained block hash, and the cache group (which fixes the form).

    A validated tuple: lookups build thousands per request, and tuple hashing / equality run in C.
    """

    __slots__ = ()

    def __new__(cls, namespace: bytes, block_hash: bytes, group: str, form: CacheForm) -> ObjectKey:
        if len(namespace) != NAMESPACE_BYTES or len(block_hash) != HASH_BYTES:
            raise ValueError("namespace and block hash must be 16-byte digests")
        if not group or (len(group) > 32 if group.isascii() else len(group.encode()) > 32):
            raise ValueError("group name must be 1..32 bytes")
        return tuple.__new__(cls, (namespace, block_hash, group, form))


@dataclasses.dataclass(frozen=True, slots=True)
class LoadRequest:
    """Load one object into `out` (a uint8 view of a pool slot, exactly the object's payload bytes)."""

    key: ObjectKey
    out: torch.Tensor
    layout_digest: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class KeyPage:
    """One page of the live records of a namespace, as an engine tier keeps them in memory to answer lookups."""

    keys: list[tuple[bytes, str]]  # (block hash, group) of each live record, in index order
    cursor: bytes  # `after` for the next page (opaque); b"" once the namespace's records are done
    txn: int  # the index snapshot it was read from (LMDB's txn id): the same id again means nothing changed


MoreRequests = Callable[[], Sequence[LoadRequest]]


def every_request(requests: Sequence[LoadRequest], more: MoreRequests | None) -> Sequence[LoadRequest]:
    """All of a `load_into`'s requests, for a tier that reads nothing before it has them all."""
    return requests if more is None else [*requests, *more()]


@runtime_checkable
class LowerTier(Protocol):
    """has / load_into / store(_many) / pin / remove, answering with the check vector's reasons."""

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        """Per key: Reason.OK if a load would be attempted, else why not (missing, stale_version, abi_mismatch, ...)."""
        ...

    def load_into(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> list[Reason]:
        """Fill each `out` with the verified payload; OK, or why not (the bytes of `out` are then unspecified).

        `more`, if given, returns the load's other requests: the tier calls it exactly once before it returns
        (unless it raises first) and answers `requests`, then `more`'s, in that order. A tier that reads as it
        goes calls it once the reads of `requests` are under way, so the caller prepares the rest (claims their
        slots) while the disk reads the first; one that does not calls it first (`every_request`)."""
        ...

    def store(self, key: ObjectKey, payload: torch.Tensor, layout_digest: bytes) -> None:
        """Persist one sealed object (uint8 tensor); durable when it returns. Raises StoreFull when over budget."""
        ...

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        """Persist a batch (key, payload, layout digest) with one sync: all durable, or none (raises)."""
        ...

    def pin(self, keys: Sequence[ObjectKey], ttl_s: float) -> int:
        """Protect objects from eviction until now + ttl_s; returns how many were found."""
        ...

    def remove(self, keys: Sequence[ObjectKey]) -> int:
        """Drop objects (they become misses); returns how many existed."""
        ...
