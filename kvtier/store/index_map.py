"""The index's pages mapped into this process before its first lookups.

Contract: `map_in(index)` maps the pages the index uses (up to PREFETCH_INDEX_BYTES) into this process's page tables
now and returns the bytes it mapped: 0 where it cannot (no such advice in the kernel, the mapping not found). It maps
PIECE_BYTES at a time, each piece inside a read transaction of its own: no map resize moves the map under a piece, and
a resize (which waits for this process's transactions) waits for one piece at most. Reads of index pages not in the
page cache happen here, not in a load.

Why: LMDB maps the index with readahead off and every environment opened is a new mapping, so a process's first
lookups take a page fault for each index page they touch (a fault maps a few neighbours only). A store that may load
maps its index when it opens, as it takes its bounce buffers: a random small load right after open otherwise pays a
fault every few records it looks up (bench/store.py's small loads).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvtier.core.hugepages import populate_read
from kvtier.store.index import PREFETCH_INDEX_BYTES

PIECE_BYTES = 16 << 20  # mapped in per read transaction

if TYPE_CHECKING:
    from kvtier.store.index import Index


def map_in(index: Index) -> int:
    """Map the index's used pages into this process; the bytes mapped (0 where it could not)."""
    data = os.path.realpath(os.path.join(index.path, "data.mdb"))
    page = os.sysconf("SC_PAGE_SIZE")
    done = 0
    while True:
        with index.read():  # (the map stays where it is while this transaction is open)
            span = _mapping(data)
            if span is None:
                return done
            used = (index.env.info()["last_pgno"] + 1) * index.env.stat()["psize"]
            end = min(span[1] - span[0], used, os.path.getsize(data), PREFETCH_INDEX_BYTES)
            size = min(PIECE_BYTES, end - end % page - done)
            if size <= 0 or not populate_read(span[0] + done, size):
                return done
            done += size


def _mapping(path: str) -> tuple[int, int] | None:
    """The start and end of this process's mapping of `path` from its first byte (/proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == path and int(fields[2], 16) == 0:
                    lo, hi = fields[0].split("-")
                    return int(lo, 16), int(hi, 16)
    except OSError:
        return None
    return None
