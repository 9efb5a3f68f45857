"""The live records of a namespace, page by page, from the index keys alone: what an engine tier keeps in memory
to answer lookups without a store read. The entry is not unpacked or seal-checked (only its state byte is
read): a record this reports live that is not is caught by the load, which verifies everything."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from kvtier.core.tier import KeyPage
from kvtier.store.errors import StoreRequestError
from kvtier.store.index import Index, RecordState

_STATE_AT = 1  # byte 1 of every entry body (v1 and v2): its RecordState


def live_keys(index: Index, namespace: bytes, after: bytes, limit: int) -> KeyPage:
    """Up to `limit` index entries of `namespace` after the key `after` (b"": from its first), the live ones kept."""
    if (after and after[:16] != namespace) or limit < 0:
        raise StoreRequestError("live_keys(): `after` must be a cursor of this namespace and `limit` >= 0")
    keys: list[tuple[bytes, str]] = []
    last, scanned = b"", 0
    with index.read() as txn:
        cursor = txn.cursor(db=index.obj)
        if limit and cursor.set_range(after + b"\0" if after else namespace):  # b"\0": the first key past `after`
            for raw, value in cast("Iterator[tuple[bytes, bytes]]", cursor.iternext()):  # buffers=False: bytes
                if raw[:16] != namespace:
                    break
                if value[_STATE_AT] == RecordState.LIVE:
                    keys.append((raw[16:32], raw[33:].decode()))
                last, scanned = raw, scanned + 1
                if scanned == limit:
                    break
        return KeyPage(keys, last if scanned == limit else b"", txn.id())
