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
Where neither is given, Linux 6.1+ still moves a memfd's pages onto transparent huge pages after they are taken:
madvise(MADV_COLLAPSE) copies each 2 MiB of a mapping aligned to 2 MiB onto one huge page whatever `shmem_enabled`
says (only `deny` refuses), and every mapping of the memfd then sees the huge page (`read_host` tries it on one 2 MiB
memfd: `HostPages.collapse`). `shared_pages` makes the choice from what the kernel says (`read_host`), and where it
finds none of them the memory works as before with small pages; `huge_bytes` tells which one a mapping really got.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import errno
import mmap
import os
from collections.abc import Callable, Iterable
from pathlib import Path

HUGE_PAGE = 2 << 20  # x86_64 and aarch64 (4 KiB base pages): a PMD maps 2 MiB
_MADV_HUGEPAGE = 14
_MADV_POPULATE_READ = 22  # Linux 5.14+
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_MADV_COLLAPSE = 25  # Linux 6.1+ (shared memory included)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
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


def populate_read(addr: int, length: int) -> bool:
    """Map every page of [addr, addr + length) of a file mapping into this process now, for reading, each read from
    the file where the page cache lacks it (MADV_POPULATE_READ): the first touches then take no page faults. Whether
    it did: False where the kernel lacks the advice (before 5.14) or refuses the range (past the file's end)."""
    return _madvise(addr, length, _MADV_POPULATE_READ) == 0


def collapse(addr: int, length: int) -> bool:
    """Ask the kernel to move the pages of [addr, addr + length) (whole 2 MiB ranges of a mapping aligned to 2 MiB,
    their pages taken) onto transparent huge pages now (MADV_COLLAPSE); whether it did. It refuses, and the pages
    stay as they were, where it has no such advice (before 6.1), `shmem_enabled` is `deny`, no huge page can be had
    (fragmented memory) or someone holds a page (a read in flight into it)."""
    return _madvise(addr, length, _MADV_COLLAPSE) == 0


class _Mapping:
    """One range of this process's address space, unmapped when the last reference to it goes."""

    def __init__(self, start: int, length: int) -> None:
        self.start, self.length = start, length

    def __del__(self) -> None:
        _libc.munmap(self.start, self.length)


def map_shared(fd: int, size: int, align: int = HUGE_PAGE) -> ctypes.Array[ctypes.c_char]:
    """The first `size` bytes of file `fd`, mapped shared and writable at an address aligned to `align` (so each
    2 MiB of the file can be one huge page: mmap aligns a memfd only where shmem_enabled grants huge pages; a
    hugetlb file's mapping must start on its page size), as a writable buffer that keeps the mapping while anything
    refers to it (a tensor made by torch.frombuffer does). OSError where the kernel refuses the mapping (e.g.
    ENOMEM: hugetlb pages that cannot be reserved)."""
    # Reserve the span plus one alignment with no access (nothing is committed), then map the file over its
    # aligned part: the reservation's leftovers stay inaccessible and are unmapped with it.
    span = size + align
    start = _libc.mmap(None, span, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if start in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot reserve {span:,} bytes of address space: {os.strerror(err)}")
    owner = _Mapping(start, span)
    at = -(-start // align) * align
    got = _libc.mmap(at, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != at:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {size:,} bytes of shared memory: {os.strerror(err)}")
    buf = (ctypes.c_char * size).from_address(at)
    buf.mapping = owner  # type: ignore[attr-defined]  # (ctypes instances take attributes: the buffer owns it)
    return buf


def collapse_works() -> bool:
    """Whether MADV_COLLAPSE moves a memfd's pages onto a huge page on this host now: tried on one 2 MiB memfd."""
    try:
        fd = os.memfd_create("kvtier-collapse-probe", os.MFD_CLOEXEC)
    except OSError:
        return False
    try:
        os.ftruncate(fd, HUGE_PAGE)
        buf = map_shared(fd, HUGE_PAGE)
        addr = ctypes.addressof(buf)
        return populate(addr, HUGE_PAGE) and collapse(addr, HUGE_PAGE)
    except OSError:  # no memory for even this: no huge pages either
        return False
    finally:
        os.close(fd)


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
    COLLAPSE = "collapse"  # a plain memfd on small pages, moved onto transparent huge pages once made (MADV_COLLAPSE)
    SMALL = "small"  # a plain memfd on base pages: restores read in smaller requests


@dataclasses.dataclass(frozen=True, slots=True)
class HostPages:
    """What the kernel says about large pages for shared memory, as `read_host` reads it."""

    shmem_enabled: str  # transparent_hugepage/shmem_enabled's word, or 'absent'
    hugetlb_free: int  # hugetlb pages free and not promised to a mapping (HugePages_Free - HugePages_Rsvd)
    hugetlb_page: int  # bytes of one hugetlb page of the default size (Hugepagesize); 0 where there are none
    collapse: bool = False  # MADV_COLLAPSE moved a memfd's pages onto a huge page when asked (`collapse_works`)


@dataclasses.dataclass(frozen=True, slots=True)
class PagePlan:
    """The choice for one pool (or for all of them, in `kvtier doctor`): how, why, and the fix where small."""

    how: SharedPages
    why: str
    fix: str = ""


def read_host(
    settings: Path = _SETTINGS, meminfo: Path = _MEMINFO, probe: Callable[[], bool] = collapse_works
) -> HostPages:
    """The kernel's answer now; whatever cannot be read counts as no large pages (fail closed to small pages).
    `probe` tries MADV_COLLAPSE where shmem_enabled grants no huge pages (where it does, it is not needed)."""
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
    collapses = word not in SHMEM_GRANTS and probe()
    return HostPages(word, max(free, 0), fields.get("Hugepagesize", 0), collapses)


def whole_pages(nbytes: int, page: int) -> int:
    """`nbytes` rounded up to whole pages of `page` bytes (a MFD_HUGETLB memfd's size must be; a pool moved onto huge
    pages takes whole ones); `nbytes` where `page` is 0."""
    return -(-nbytes // page) * page if page else nbytes


def shared_pages(host: HostPages, sizes: Iterable[int]) -> PagePlan:
    """How shared pools of these byte sizes (one memfd each) get their pages on this host: transparent huge pages
    where shmem_enabled grants them (they take nothing set aside for others); else hugetlb pages where the free
    reserved ones cover every pool whole (each rounded up to whole pages); else small pages moved onto transparent
    huge pages once made where MADV_COLLAPSE does that here (pools of one huge page or more); else small pages,
    with the fix."""
    sizes = list(sizes)
    if host.shmem_enabled in SHMEM_GRANTS:
        return PagePlan(SharedPages.THP, f"transparent huge pages (shmem_enabled = {host.shmem_enabled})")
    page = host.hugetlb_page or HUGE_PAGE
    need = sum(whole_pages(n, page) for n in sizes) // page
    reserved = f"{host.hugetlb_free} free reserved hugetlb pages"
    if host.hugetlb_page and host.hugetlb_free >= need > 0:
        return PagePlan(
            SharedPages.HUGETLB,
            f"hugetlb pages (shmem_enabled = {host.shmem_enabled}; {reserved} of {page >> 20} MiB cover {need})",
        )
    if host.collapse and max(sizes, default=0) >= HUGE_PAGE:  # (a pool under one huge page has nothing to move)
        return PagePlan(
            SharedPages.COLLAPSE,
            f"transparent huge pages moved in once made (shmem_enabled = {host.shmem_enabled}; MADV_COLLAPSE, "
            "pools of 2 MiB or more)",
        )
    short = need - host.hugetlb_free
    fix = (
        "echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled (docs/systemd.md), "
        f"or raise vm.nr_hugepages by {short} and restart the daemon"
    )
    why = f"small pages (shmem_enabled = {host.shmem_enabled}; {reserved}, {need} needed)"
    return PagePlan(SharedPages.SMALL, why, fix)
