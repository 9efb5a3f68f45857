"""Preallocated pools, one per cache group: a 4096-B aligned base, fixed slot stride, never moved.

On cpu a pool lives in a memfd, so another process can map it; its pages are taken when it is made, large
pages where the kernel gives them to shared memory: transparent huge pages where `shmem_enabled` grants them,
else the host's reserved hugetlb pages (a `MFD_HUGETLB` memfd) where enough are free, else small pages, which a
pool of 2 MiB or more has moved onto transparent huge pages after it is made where MADV_COLLAPSE does that here
(`Pool.move`, run by `kvtier.gpu.page_move`) (`kvtier.core.hugepages.shared_pages`; `Pool.pages` says which was
chosen, `huge_bytes` what it got). The memfd is mapped at an address aligned to 2 MiB, so each 2 MiB of it can be
one huge page.
The daemon passes a read-only descriptor of it (`Pool.reader_fd`) over its unix socket and the client maps
it read-only at `base_offset`. The memfd is sealed against every future writable mapping once the daemon
has mapped it (`F_SEAL_FUTURE_WRITE`), so no client can write a slot: offloads reach the pool through
the daemon (see `kvtier.daemon.staging`). On cuda a pool is a plain device tensor (CUDA IPC mappings
cannot be read-only: clients there are trusted to write only their reserved slots).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os

import torch

from kvtier.core import hugepages
from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT, slot_stride
from kvtier.core.loadbatch import slot_bytes
from kvtier.gpu.errors import BudgetError
from kvtier.gpu.gentable import reader_fd, seal_for_readers
from kvtier.gpu.page_move import PageMove

log = logging.getLogger(__name__)
_MFD_HUGETLB = getattr(os, "MFD_HUGETLB", 0x0004)


@dataclasses.dataclass(slots=True)
class Pool:
    """One group's slots: `tensor` is the aligned uint8 view of `n_slots * slot_stride` bytes."""

    group: str
    form: CacheForm
    slot_nbytes: int
    slot_stride: int
    n_slots: int
    tensor: torch.Tensor
    base_offset: int
    fd: int | None
    reader_fd: int | None = None
    pages: str = "device"  # cpu: a hugepages.SharedPages value (how its memfd was made); else "device"
    move: PageMove | None = None  # its move onto huge pages, where pages is "collapse"

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def slot_view(self, slot: int) -> torch.Tensor:
        """The uint8 bytes of one slot's object (exactly `slot_nbytes`)."""
        return slot_bytes(self.tensor, self.slot_stride, self.slot_nbytes, slot)

    def close(self) -> None:
        for fd in (self.fd, self.reader_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.reader_fd = None

    def info(self) -> dict[str, object]:
        """What a client needs to map and address the pool."""
        return {
            "group": self.group,
            "form": self.form.value,
            "device": str(self.tensor.device),
            "address": self.address,
            "base_offset": self.base_offset,
            "slot_nbytes": self.slot_nbytes,
            "slot_stride": self.slot_stride,
            "n_slots": self.n_slots,
            "nbytes": self.n_slots * self.slot_stride,
            "pages": self.pages,
        }


def _raw_buffer(
    nbytes: int, device: torch.device, name: str
) -> tuple[torch.Tensor, int | None, int | None, str, PageMove | None]:
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None, None, "device", None
    host = hugepages.read_host()  # the kernel's answer now, not at startup: pages come and go
    how = hugepages.shared_pages(host, [nbytes]).how
    if how is hugepages.SharedPages.HUGETLB:
        try:
            return (*_memfd(nbytes, name, page=host.hugetlb_page, hugetlb=True), how.value, None)
        except OSError as exc:  # another process took the free pages first: small pages, never an error
            log.warning("the %s pool cannot have hugetlb pages (%s): it takes small pages", name, exc.strerror or exc)
            how = hugepages.SharedPages.SMALL
    if how is hugepages.SharedPages.COLLAPSE:  # whole huge pages: the last one is moved too (the memfd covers it)
        raw, fd, rfd = _memfd(nbytes, name, page=hugepages.HUGE_PAGE)
        return raw, fd, rfd, how.value, PageMove(raw.data_ptr(), raw.numel(), raw)
    return (*_memfd(nbytes, name), how.value, None)


def _memfd(nbytes: int, name: str, *, page: int = 0, hugetlb: bool = False) -> tuple[torch.Tensor, int, int]:
    """A sealed memfd of at least `nbytes` (whole pages of `page` bytes where given; hugetlb pages where `hugetlb`),
    mapped at an address aligned to 2 MiB and its pages taken; (the mapping, its fd, a read-only fd for clients).
    Hugetlb pages that cannot be had are an OSError."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (_MFD_HUGETLB if hugetlb else 0)
    size = hugepages.whole_pages(nbytes, page)
    fd = os.memfd_create(f"kvtier-pool-{name}", flags)
    try:
        os.ftruncate(fd, size)
        try:
            raw = torch.frombuffer(hugepages.map_shared(fd, size, max(page, hugepages.HUGE_PAGE)), dtype=torch.uint8)
        except OSError as exc:  # mmap refused: a hugetlb mapping reserves its pages when it is made
            if not hugetlb:
                raise
            raise OSError(errno.ENOMEM, f"cannot map {size:,} bytes of hugetlb pages: {exc.strerror}") from exc
        if hugetlb:
            _take_hugetlb(raw)
        else:
            _take_pages(raw, fd, name)
        seal_for_readers(fd)
        return raw, fd, reader_fd(fd)
    except BaseException:
        os.close(fd)
        raise


def _take_hugetlb(raw: torch.Tensor) -> None:
    """Fault every hugetlb page in now (their reservation was made with the mapping); where the kernel cannot
    populate a mapping (before 5.14), by writing one byte per page."""
    if not hugepages.populate(raw.data_ptr(), raw.numel()):
        raw[:: hugepages.HUGE_PAGE].zero_()


def _take_pages(raw: torch.Tensor, fd: int, name: str) -> None:
    """Take the pool's pages now, huge where the kernel gives them (kvtier.core.hugepages: restores read in
    larger requests). Now, because a restore into a fresh pool otherwise pays every page's allocation
    and zeroing inside its reads (measured: half the disk's speed), and a shared-memory limit would surface as
    SIGBUS on first touch instead of this error. Through the mapping, so the huge-page advice applies;
    fallocate(2) where the kernel cannot populate a mapping (before 5.14)."""
    nbytes = raw.numel()
    try:
        hugepages.advise_huge(raw.data_ptr(), nbytes)
        if not hugepages.populate(raw.data_ptr(), nbytes):
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise BudgetError(
            f"cannot take {nbytes:,} bytes of shared memory for the {name} pool ({exc.strerror}); "
            "lower its budget or free memory"
        ) from exc


def allocate_pool(group: str, form: CacheForm, slot_nbytes: int, budget_bytes: int, device: torch.device) -> Pool:
    """A pool of as many whole slots as `budget_bytes` holds, base aligned to 4096 B (so a slot aligned in the pool
    is aligned in memory: see `slot_stride`)."""
    stride = slot_stride(slot_nbytes)
    n_slots = budget_bytes // stride
    span = n_slots * stride
    raw, fd, rfd, pages, move = _raw_buffer(span + DISK_ALIGNMENT, device, group)
    offset = (-raw.data_ptr()) % DISK_ALIGNMENT
    tensor = raw[offset : offset + span]
    return Pool(group, form, slot_nbytes, stride, n_slots, tensor, offset, fd, rfd, pages, move)
