"""Transparent huge pages for the memory that O_DIRECT reads land in (pools, bounce buffers).

Why: a block device takes at most `max_segments` physically contiguous ranges per request (254 on a virtio
disk; NVMe drivers have similar limits), so a read into 4 KiB pages that lie apart is cut into requests of
about 1 MiB, while a read into 2 MiB pages goes as one request of up to `max_sectors_kb`. On a disk that
charges per request that is the difference: the same reads into huge pages go in fewer, larger requests and
finish sooner than into small pages (`/sys/block/<dev>/stat` counts the requests; `bench/run_all.py` records the
setting beside its figures, and docs/benchmarks.md shows them).

The kernel decides: private anonymous memory gets huge pages under `transparent_hugepage/enabled` =
`madvise` or `always`, shared memory (a memfd: kvtier's cpu pools) only under `shmem_enabled` = `advise`,
`within_size` or `always` (most distributions ship `never`). Where it says no, the memory works as before
with small pages; `huge_bytes` tells which one a mapping got.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable
from pathlib import Path

HUGE_PAGE = 2 << 20  # x86_64 and aarch64 (4 KiB base pages): a PMD maps 2 MiB
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
# smaps fields that count a mapping's bytes mapped by huge pages (anonymous, shared memory, file)
_HUGE_FIELDS = (b"AnonHugePages:", b"ShmemPmdMapped:", b"FilePmdMapped:")
_SETTINGS = Path("/sys/kernel/mm/transparent_hugepage")


def setting(name: str) -> str:
    """The kernel's choice for one transparent huge page setting (`enabled`, `shmem_enabled`, ...): the bracketed
    word of /sys/kernel/mm/transparent_hugepage/<name>, or 'absent' where the kernel has no such setting."""
    path = _SETTINGS / name
    text = path.read_text() if path.exists() else ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "absent"


def _madvise(addr: int, length: int, advice: int) -> int:
    """0, or the errno of madvise(2) on the page-aligned span that covers [addr, addr + length)."""
    start = addr - addr % os.sysconf("SC_PAGE_SIZE")
    if _libc.madvise(start, addr + length - start, advice) == 0:
        return 0
    return ctypes.get_errno()


def advise_huge(addr: int, length: int) -> bool:
    """Ask for huge pages on the mapping at [addr, addr + length) before it is touched (MADV_HUGEPAGE);
    False where the kernel has no transparent huge pages (EINVAL)."""
    err = _madvise(addr, length, _MADV_HUGEPAGE)
    if err in (0, errno.EINVAL):
        return err == 0
    raise OSError(err, f"madvise(MADV_HUGEPAGE): {os.strerror(err)}")


def populate(addr: int, length: int) -> bool:
    """Fault every page of [addr, addr + length) in for writing now, through the mapping, so its advice
    applies (fallocate(2) on a memfd takes small pages whatever the mapping asks). False where the kernel
    lacks MADV_POPULATE_WRITE (before 5.14): the caller takes its pages another way. A memory limit is an
    OSError (ENOMEM, or EFAULT where a shared-memory page could not be had), never a SIGBUS later."""
    err = _madvise(addr, length, _MADV_POPULATE_WRITE)
    if err in (0, errno.EINVAL):
        return err == 0
    raise OSError(err, f"cannot take {length:,} bytes of memory: {os.strerror(err)}")


def huge_bytes(spans: Iterable[tuple[int, int]]) -> int:
    """Bytes mapped by huge pages in the mappings of this process that overlap any (address, length) of `spans`,
    in one pass over /proc/self/smaps (a daemon's smaps is long enough that one pass per pool would show at startup)."""
    ranges = [(addr, addr + length) for addr, length in spans]
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_bytes().splitlines():
        head = line.split(b" ", 1)[0]
        if b"-" in head and not head.endswith(b":"):
            lo, _, hi = head.partition(b"-")
            start, end = int(lo, 16), int(hi, 16)
            inside = any(a < end and b > start for a, b in ranges)
        elif inside and line.startswith(_HUGE_FIELDS):
            total += int(line.split()[1]) * 1024
    return total
