"""Records and bytes per namespace, as the index has them now (what `kvtier status` and `namespace list` show).

Index keys begin with their namespace (`encode_key`), so one pass over the object table groups them without
reading any payload; the cost is one index entry decoded per record (about a second per million records).
"""

from __future__ import annotations

import dataclasses

from kvtier.store.context import entry_or_none
from kvtier.store.store import DiskStore


@dataclasses.dataclass(slots=True)
class NamespaceUsage:
    records: int = 0
    bytes: int = 0  # record bytes on disk (header and alignment included)


def namespace_usage(store: DiskStore) -> dict[bytes, NamespaceUsage]:
    """Per namespace with at least one record: its records (serving or quarantined) and their bytes."""
    index = store.index
    out: dict[bytes, NamespaceUsage] = {}
    with index.read() as txn:
        for raw_key, raw in txn.cursor(db=index.obj):
            entry = entry_or_none(raw)
            use = out.setdefault(bytes(raw_key[:16]), NamespaceUsage())
            use.records += 1
            use.bytes += entry.record_len if entry is not None else 0
    return out
