"""Transparent huge pages for the memory that O_DIRECT reads land in (pools, bounce buffers).

Why: a block device takes at most `max_segments` physically contiguous ranges per request (254 on a virtio
disk; NVMe drivers have similar limits), so a read into 4 KiB pages that lie apart is cut into requests of
about 1 MiB, while a read into 2 MiB pages goes as one request of up to `max_sectors_kb`. On a disk that
charges per request that is the difference: the same reads into huge pages go in fewer, larger requests and
finish sooner than into small pages (`/sys/block/<dev>/stat` counts the requests; `bench/run_all.py` records the
setting beside its figures, and docs/benchmarks.md shows them).

The kernel decides: private anonymous memory gets huge pages under `transparent_hugepage/enabled` =
`madvise` or `always`, shared memory (a memfd: kvtier's cpu pools) only under `shmem_enabled` = `advise`,
`within_size` or `always` (most distributions ship `never`). The per-size settings of newer kernels
(`hugepages-2048kB/shmem_enabled`) govern only anonymous shared mappings, which another process cannot map,
never a memfd. Where transparent huge pages are refused, a pool can still be a `MFD_HUGETLB` memfd, shared the
same way, when the host has reserved enough hugetlb pages (`vm.nr_hugepages`); stock hosts reserve none.
`shared_pages` makes that choice from what the kernel says (`read_host`), and where it finds neither the
memory works as before with small pages; `huge_bytes` tells which one a mapping really got.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
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
# smaps fields that count a mapping's bytes mapped by huge pages: transparent ones (anonymous, shared memory, file)
# and hugetlb pages (a MFD_HUGETLB memfd), which smaps counts apart from the others
_HUGE_FIELDS = (b"AnonHugePages:", b"ShmemPmdMapped:", b"FilePmdMapped:", b"Shared_Hugetlb:", b"Private_Hugetlb:")
_SETTINGS = Path("/sys/kernel/mm/transparent_hugepage")
_MEMINFO = Path("/proc/meminfo")
# shmem_enabled words under which a memfd mapped with MADV_HUGEPAGE gets transparent huge pages
SHMEM_GRANTS = ("advise", "within_size", "always", "force")


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


# ---- how shared memory gets large pages --------------------------------------------------------------------------


class SharedPages(enum.Enum):
    """How a shared-memory pool gets its pages."""

    THP = "thp"  # a plain memfd, MADV_HUGEPAGE: transparent huge pages (shmem_enabled grants them)
    HUGETLB = "hugetlb"  # a MFD_HUGETLB memfd: the host's reserved hugetlb pages
    SMALL = "small"  # a plain memfd on base pages: restores read in smaller requests


@dataclasses.dataclass(frozen=True, slots=True)
class HostPages:
    """What the kernel says about large pages for shared memory, as `read_host` reads it."""

    shmem_enabled: str  # transparent_hugepage/shmem_enabled's word, or 'absent'
    hugetlb_free: int  # hugetlb pages free and not promised to a mapping (HugePages_Free - HugePages_Rsvd)
    hugetlb_page: int  # bytes of one hugetlb page of the default size (Hugepagesize); 0 where there are none


@dataclasses.dataclass(frozen=True, slots=True)
class PagePlan:
    """The choice for one pool (or for all of them, in `kvtier doctor`): how, why, and the fix where small."""

    how: SharedPages
    why: str
    fix: str = ""


def read_host(settings: Path = _SETTINGS, meminfo: Path = _MEMINFO) -> HostPages:
    """The kernel's answer now; whatever cannot be read counts as no large pages (fail closed to small pages)."""
    path = settings / "shmem_enabled"
    try:
        text = path.read_text()
    except OSError:
        text = ""
    word = text[text.index("[") + 1 : text.index("]")] if "[" in text and "]" in text else "absent"
    fields: dict[str, int] = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    free = fields.get("HugePages_Free", 0) - fields.get("HugePages_Rsvd", 0)
    return HostPages(word, max(free, 0), fields.get("Hugepagesize", 0))


def hugetlb_bytes(nbytes: int, page: int) -> int:
    """`nbytes` rounded up to whole hugetlb pages (a MFD_HUGETLB memfd's size must be)."""
    return -(-nbytes // page) * page if page else nbytes


def shared_pages(host: HostPages, sizes: Iterable[int]) -> PagePlan:
    """How shared pools of these byte sizes (one memfd each) get their pages on this host: transparent huge pages
    where shmem_enabled grants them (they take nothing set aside for others); else hugetlb pages where the free
    reserved ones cover every pool whole (each rounded up to whole pages); else small pages, with the fix."""
    sizes = list(sizes)
    if host.shmem_enabled in SHMEM_GRANTS:
        return PagePlan(SharedPages.THP, f"transparent huge pages (shmem_enabled = {host.shmem_enabled})")
    page = host.hugetlb_page or HUGE_PAGE
    need = sum(hugetlb_bytes(n, page) for n in sizes) // page
    reserved = f"{host.hugetlb_free} free reserved hugetlb pages"
    if host.hugetlb_page and host.hugetlb_free >= need > 0:
        return PagePlan(
            SharedPages.HUGETLB,
            f"hugetlb pages (shmem_enabled = {host.shmem_enabled}; {reserved} of {page >> 20} MiB cover {need})",
        )
    short = need - host.hugetlb_free
    fix = (
        "echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled (docs/systemd.md), "
        f"or raise vm.nr_hugepages by {short} and restart the daemon"
    )
    why = f"small pages (shmem_enabled = {host.shmem_enabled}; {reserved}, {need} needed)"
    return PagePlan(SharedPages.SMALL, why, fix)
