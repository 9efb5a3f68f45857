"""The on-disk prefix store: LMDB index + aligned, checksummed, append-only segments (see FORMAT.md).

These exports are the package's public interface; other packages import nothing from its submodules. Besides
`DiskStore` and its records and errors, the store layout other processes need to read a store's files: where
the index and the segments are (`INDEX_DIR`, `SEGMENTS_DIR`, `segment_name`, `parse_segment_name`), how a key
is spelled in the index (`encode_key` / `decode_key`), which forms a record can carry (`RECORD_FORMS`), and
`SpanReader`: segment bytes read as they lie, a benchmark's bound on a cold load; and how a segment file is deleted
(`unlink_in_steps`), for the verifier's removal of stray files.
"""

from kvtier.core.store_config import StoreConfig, StoreLimits
from kvtier.store.channel import DaemonUnavailable, DecisionClient, DecisionServer, applier_pid
from kvtier.store.decisions import DropIf, PutDoc
from kvtier.store.errors import (
    CorruptRecord,
    FormatVersionError,
    NamespaceError,
    NamespaceRetired,
    QuarantineReason,
    StoreError,
    StoreForkError,
    StoreFull,
    StoreLocked,
    StoreReadOnly,
    StoreRequestError,
)
from kvtier.store.index import INDEX_DIR, IndexEntry, NamespaceEntry, RecordState, SegmentEntry, decode_key, encode_key
from kvtier.store.index_page import IndexPage
from kvtier.store.io import unlink_in_steps
from kvtier.store.maintenance import RecordInfo, VerifyResult
from kvtier.store.ns_usage import NamespaceUsage, namespace_usage
from kvtier.store.rebuild import RebuildReport, rebuild_index
from kvtier.store.record import RECORD_FORMS
from kvtier.store.segments import SEGMENTS_DIR, parse_segment_name, segment_name
from kvtier.store.span_read import SpanReader
from kvtier.store.store import DiskStore

__all__ = [
    "INDEX_DIR",
    "RECORD_FORMS",
    "SEGMENTS_DIR",
    "CorruptRecord",
    "DaemonUnavailable",
    "DecisionClient",
    "DecisionServer",
    "DiskStore",
    "DropIf",
    "FormatVersionError",
    "IndexEntry",
    "IndexPage",
    "NamespaceEntry",
    "NamespaceError",
    "NamespaceRetired",
    "NamespaceUsage",
    "PutDoc",
    "QuarantineReason",
    "RebuildReport",
    "RecordInfo",
    "RecordState",
    "SegmentEntry",
    "SpanReader",
    "StoreConfig",
    "StoreError",
    "StoreForkError",
    "StoreFull",
    "StoreLimits",
    "StoreLocked",
    "StoreReadOnly",
    "StoreRequestError",
    "VerifyResult",
    "applier_pid",
    "decode_key",
    "encode_key",
    "namespace_usage",
    "parse_segment_name",
    "rebuild_index",
    "segment_name",
    "unlink_in_steps",
]
