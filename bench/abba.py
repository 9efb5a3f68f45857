"""Side-by-side rounds for the engine benches (bench/sglang_hicache.py, bench/vllm_dsv4.py).

Two sides (kvtier and an engine's own tier) run in ABBA order, round after round (A B, B A, A B, ...), so
neither always runs first on a disk or a CPU that warms or tires over a run. Before each timed read the
files both sides wrote are evicted from the page cache with `posix_fadvise(DONTNEED)` (after an fsync, so
their pages are clean): per file, on exactly those files, rather than `echo 3 > /proc/sys/vm/drop_caches`,
which needs root and empties the cache of every other process on the host as well. Whether the eviction
took is not assumed: each side's files are probed with `mincore(2)` after it, and a round whose files still
have pages in memory is reported `warm`, with the resident bytes, rather than passed off as cold. The one
exception is a file this process has memory-mapped (kvtier's LMDB index, which a serving process keeps
mapped): the kernel does not evict mapped pages on advice, so they are counted apart (`mapped_bytes`) and do
not make a round warm; every file read through read(2) or O_DIRECT must have no page left.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import statistics
from collections.abc import Iterable
from pathlib import Path

from pagecache import drop_cache_tree

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def abba(a: str, b: str, rounds: int) -> list[str]:
    """The order the two sides run in: `a b` in even rounds, `b a` in odd ones."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    return [s for r in range(rounds) for s in ((a, b) if r % 2 == 0 else (b, a))]


def resident_bytes(path: str | Path) -> int:
    """Bytes of the file at `path` in the page cache now, as mincore(2) sees them (a mapping that faults
    nothing in)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            resident = sum(v & 1 for v in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * mmap.PAGESIZE, size)


def files_under(path: str | Path) -> list[Path]:
    root = Path(path)
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]


def mapped_files() -> set[Path]:
    """The files this process has memory-mapped now (/proc/self/maps)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                found.add(Path(fields[5].rstrip("\n")))
    return found


def evict(sides: dict[str, Iterable[str | Path]]) -> dict[str, dict]:
    """Evict every file under each side's folders from the page cache, then probe what stayed resident.

    Returns, per side, `cache` (`cold` when no file it reads through the page cache or O_DIRECT has a page
    in memory after the eviction, else `warm`), `resident_bytes` (of those files), `mapped_bytes` (resident
    pages of files this process keeps mapped) and `file_bytes`.
    """
    folders = {side: list(paths) for side, paths in sides.items()}
    for paths in folders.values():
        for folder in paths:
            drop_cache_tree(folder)
    mapped = mapped_files()
    out = {}
    for side, paths in folders.items():
        files = [f for folder in paths for f in files_under(folder)]
        held = [f for f in files if f.resolve() in mapped]
        resident = sum(resident_bytes(f) for f in files if f not in held)
        out[side] = {
            "cache": "cold" if resident == 0 else "warm",
            "resident_bytes": resident,
            "mapped_bytes": sum(resident_bytes(f) for f in held),
            "file_bytes": sum(f.stat().st_size for f in files),
        }
    return out


def overall(rounds: list[dict]) -> str:
    """`cold` when every timed read found its own side's files and the other side's (`other_side`) cold."""
    states = [r["cache"] for r in rounds] + [r["other_side"]["cache"] for r in rounds if r.get("other_side")]
    return "cold" if all(s == "cold" for s in states) else "warm"


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    """Median, fastest and slowest of one side's rounds, and (slowest - fastest) / median."""
    med = statistics.median(values)
    return {
        "median": round(med, digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "spread": round((max(values) - min(values)) / med, 3) if med else 0.0,
    }
