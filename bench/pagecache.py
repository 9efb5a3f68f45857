"""Cold reads for the benchmarks: evict a store's files from the page cache."""

from __future__ import annotations

import os
from pathlib import Path


def drop_cache_tree(path: str | Path) -> None:
    """Evict every file under `path` from the page cache (after fsync, so the pages are clean)."""
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
