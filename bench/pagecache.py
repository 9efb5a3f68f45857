"""Cold reads for the benchmarks: evict a store's files from the page cache, and time the raw-device baseline."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


def drop_cache_tree(path: str | Path) -> None:
    """Evict every file under `path` from the page cache."""
    for d, _, files in os.walk(path):
        for name in files:
            drop_cache_file(os.path.join(d, name))


def drop_cache_file(path: str | Path) -> None:
    """Evict one file from the page cache (after fsync, so its pages are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_direct_s(path: str | Path, offset: int = 0, nbytes: int | None = None) -> float:
    """Seconds `dd iflag=direct bs=4M` takes (as dd reports it, process start excluded) to read `nbytes` of
    `path` from `offset` (4096-aligned; all of the file by default)."""
    span = [] if nbytes is None else [f"skip={offset}", f"count={nbytes}"]
    res = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", *span, "iflag=direct,skip_bytes,count_bytes"],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"copied, ([0-9.e-]+) s", res.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {res.stderr!r}")
    return float(m.group(1))
