"""Typed errors of the disk store; each message says what to do."""

from __future__ import annotations

import enum

from kvtier.core.errors import KvtierError, OutOfRoom, VersionError
from kvtier.core.forms import Reason


class StoreError(KvtierError):
    """Base of the disk store's errors."""

    code = "store_error"


class StoreFull(StoreError, OutOfRoom):
    """A write would exceed the byte budget, a per-form quota, or the filesystem; nothing was made visible. The
    budget's and the quotas' refusals say the room left and the bytes needed (`OutOfRoom`)."""

    code = "store_full"


class FormatVersionError(StoreError):
    """The store (or a segment) was written by a newer kvtier format than this one reads."""

    code = "store_format"


class StoreLocked(StoreError):
    """Another process holds the store's writer lock."""

    code = "store_locked"


class StoreReadOnly(StoreError):
    """A write was attempted through a store opened without the writer role."""

    code = "store_read_only"


class NamespaceError(StoreError):
    """A write named a namespace that is not registered, or is retired."""

    code = "store_namespace"


class NamespaceRetired(NamespaceError, VersionError):
    """A write named a retired namespace (a version rollout retired it, perhaps while the write was under way):
    nothing of it was stored. A `VersionError`, so the pool's write-back knows it for a rollout, not a fault."""

    code = "store_namespace_retired"


class StoreRequestError(StoreError):
    """A caller passed a tensor the store cannot use (dtype, contiguity, size)."""

    code = "store_request"


class StoreForkError(StoreError):
    """A store object was used in a child after fork(); LMDB and cuFile handles do not survive a fork."""

    code = "store_fork"


class QuarantineReason(enum.IntEnum):
    """Why a record was taken out of service; stored in the index with the time."""

    INDEX_VALUE = 1
    HEADER = 2
    HEADER_MISMATCH = 3
    PAYLOAD = 4
    SEGMENT_MISSING = 5
    SEGMENT_TRUNCATED = 6
    DECODE = 7
    EXTERNAL = 8
    LAYOUT = 9  # the layout digest is not what its namespace's version key implies (found by the verifier)

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def miss_reason(self) -> Reason:
        """The check-vector reason a reader gets for a record quarantined for this."""
        if self is QuarantineReason.SEGMENT_MISSING:
            return Reason.MISSING
        return Reason.ABI_MISMATCH if self is QuarantineReason.LAYOUT else Reason.CORRUPT


class CorruptRecord(StoreError):
    """Internal: a record failed verification; it is quarantined and the caller sees a miss."""

    code = "corrupt"

    def __init__(self, reason: QuarantineReason, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason.label}: {detail}")
