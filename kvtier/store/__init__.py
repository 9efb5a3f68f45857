"""The on-disk prefix store: LMDB index + aligned, checksummed, append-only segments (see FORMAT.md)."""

from kvtier.store.errors import (
    CorruptRecord,
    FormatVersionError,
    NamespaceError,
    QuarantineReason,
    StoreError,
    StoreForkError,
    StoreFull,
    StoreLocked,
    StoreReadOnly,
    StoreRequestError,
)
from kvtier.store.index import IndexEntry, NamespaceEntry, RecordState, SegmentEntry
from kvtier.store.rebuild import RebuildReport, rebuild_index
from kvtier.store.store import DiskStore, RecordInfo, StoreConfig, StoreLimits, VerifyResult

__all__ = [
    "CorruptRecord",
    "DiskStore",
    "FormatVersionError",
    "IndexEntry",
    "NamespaceEntry",
    "NamespaceError",
    "QuarantineReason",
    "RebuildReport",
    "RecordInfo",
    "RecordState",
    "SegmentEntry",
    "StoreConfig",
    "StoreError",
    "StoreForkError",
    "StoreFull",
    "StoreLimits",
    "StoreLocked",
    "StoreReadOnly",
    "StoreRequestError",
    "VerifyResult",
    "rebuild_index",
]
