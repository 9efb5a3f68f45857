"""Records and bytes per namespace (what `kvtier status` and `namespace list` show), kept as rows of the index.

The daemon answers every `stats` (`kvtier status`, each metrics scrape, a monitor's poll) with these figures, in
the process that serves loads and offloads. Counting them by walking the object table cost one decoded entry per
record on every call (about a second per million records, all of it holding the GIL the engine's offloads wait
for), so they are kept instead: one row per namespace in `meta` (`nsuse:` + namespace, sealed `>qq`: records,
record bytes), changed by the same write transaction that adds, drops or moves a record (`accounting.Ledger`).

A row is trusted only while the index is as the rows last saw it: `nsuse_stamp` holds xxh3_64 of `meta.seq` and
`meta.usage` as of the transaction that last kept the rows, and every transaction that adds or drops a record
changes one of the two (a write takes new sequence numbers; a drop lowers a form's usage). A writer that does not
keep the rows (a kvtier from before them, run on the store in between) therefore leaves the stamp stale, and so
does a store rebuilt or written before them. A stale stamp is never kept up: readers count the object table as
before (`namespace_usage`), and the next writer to open the store counts it once and writes the rows
(`repair`).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time

import lmdb
import xxhash

from kvtier.store.context import entry_or_none
from kvtier.store.errors import CorruptRecord
from kvtier.store.index import Index, seal, unseal

log = logging.getLogger(__name__)

ROW_PREFIX = b"nsuse:"
STAMP = b"nsuse_stamp"
NAMESPACE_BYTES = 16  # an object key begins with its namespace (`encode_key`)
_ROW = struct.Struct(">qq")
_STAMP = struct.Struct(">Q")


@dataclasses.dataclass(slots=True)
class NamespaceUsage:
    records: int = 0
    bytes: int = 0  # record bytes on disk (header and alignment included)


def _stamp(index: Index, txn: lmdb.Transaction) -> bytes:
    seq = txn.get(b"seq", db=index.meta)
    usage = txn.get(b"usage", db=index.meta)
    h = xxhash.xxh3_64(b"" if seq is None else bytes(seq))
    h.update(b"\0" + (b"" if usage is None else bytes(usage)))
    return _STAMP.pack(h.intdigest())


def rows_current(index: Index, txn: lmdb.Transaction) -> bool:
    """Whether the rows describe the index as `txn` sees it (see the module's docstring)."""
    raw = txn.get(STAMP, db=index.meta)
    try:
        return raw is not None and unseal(raw) == _stamp(index, txn)
    except CorruptRecord:
        return False


def read_row(index: Index, txn: lmdb.Transaction, namespace: bytes) -> NamespaceUsage:
    """The row of `namespace` (zeros where it has none); CorruptRecord if its seal fails."""
    raw = txn.get(ROW_PREFIX + namespace, db=index.meta)
    return NamespaceUsage() if raw is None else NamespaceUsage(*_ROW.unpack(unseal(raw)))


def save_rows(index: Index, txn: lmdb.Transaction, rows: dict[bytes, NamespaceUsage]) -> None:
    """Write `rows` (a namespace left with no record loses its row) and stamp the index as it is now: last in the
    transaction, after `meta.seq` and `meta.usage` have their new values."""
    for ns, row in rows.items():
        if row.records > 0:
            txn.put(ROW_PREFIX + ns, seal(_ROW.pack(row.records, row.bytes)), db=index.meta)
        else:
            txn.delete(ROW_PREFIX + ns, db=index.meta)
    txn.put(STAMP, seal(_stamp(index, txn)), db=index.meta)


def _rows(index: Index, txn: lmdb.Transaction) -> dict[bytes, NamespaceUsage]:
    out: dict[bytes, NamespaceUsage] = {}
    with txn.cursor(db=index.meta) as cur:
        more = cur.set_range(ROW_PREFIX)
        while more and (key := bytes(cur.key())).startswith(ROW_PREFIX):
            out[key[len(ROW_PREFIX) :]] = NamespaceUsage(*_ROW.unpack(unseal(cur.value())))
            more = cur.next()
    return out


def _count(index: Index, txn: lmdb.Transaction) -> dict[bytes, NamespaceUsage]:
    """One pass over the object table: every entry counts as a record, with its bytes where its value is readable
    (the usage a corrupt value was added with is unknown here)."""
    out: dict[bytes, NamespaceUsage] = {}
    for raw_key, raw in txn.cursor(db=index.obj):
        entry = entry_or_none(raw)
        use = out.setdefault(bytes(raw_key[:NAMESPACE_BYTES]), NamespaceUsage())
        use.records += 1
        use.bytes += entry.record_len if entry is not None else 0
    return out


def _trusted_rows(index: Index, txn: lmdb.Transaction) -> dict[bytes, NamespaceUsage] | None:
    """The rows, where they are current and every one is readable; else None."""
    if not rows_current(index, txn):
        return None
    try:
        return _rows(index, txn)
    except CorruptRecord:
        log.warning("%s: a namespace usage row is corrupt: counting the object table", index.path)
        return None


def namespace_usage(index: Index) -> dict[bytes, NamespaceUsage]:
    """Per namespace with at least one record: its records (serving or quarantined) and their bytes. Reads the
    rows where they are trusted, else counts the object table."""
    with index.read() as txn:
        rows = _trusted_rows(index, txn)
        return rows if rows is not None else _count(index, txn)


def recount(index: Index, txn: lmdb.Transaction) -> int:
    """Replace every row with a count of the object table, inside the caller's write transaction, and stamp it;
    returns the records counted."""
    with txn.cursor(db=index.meta) as cur:
        more = cur.set_range(ROW_PREFIX)
        while more and bytes(cur.key()).startswith(ROW_PREFIX):
            more = cur.delete()
    counted = _count(index, txn)
    save_rows(index, txn, counted)
    return sum(u.records for u in counted.values())


def repair(index: Index) -> None:
    """At a writer's open: count the rows once where they are stale or one is corrupt (see the module's
    docstring)."""
    with index.read() as txn:
        if _trusted_rows(index, txn) is not None:
            return
    t0 = time.monotonic()
    records = index.update(lambda txn: recount(index, txn))
    log.info(
        "%s: counted %d records per namespace in %.2f s (the rows were stale, absent or corrupt)",
        index.path,
        records,
        time.monotonic() - t0,
    )
