"""A real daemon on a host whose shmem_enabled refuses transparent huge pages but which has reserved hugetlb pages:
its pools are hugetlb memfds (its log says so, its smaps counts them), a restore reads into them from disk, and an
engine reads the bytes through the read-only mapping it is handed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core import hugepages
from kvtier.core.profile import load_profile
from support.daemon import DaemonProc
from support.workload import through_disk

PROFILE = load_profile("ref-tiny")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
PAGES = 64  # more than the default test pools' memfds take, each rounded up to whole 2 MiB pages

pytestmark = [
    pytest.mark.alone,  # vm.nr_hugepages is the host's: another worker's test reserving pages races it
    pytest.mark.skipif(os.geteuid() != 0, reason="reserving hugetlb pages (vm.nr_hugepages) needs root"),
    pytest.mark.skipif(
        hugepages.read_host().shmem_enabled in hugepages.SHMEM_GRANTS,
        reason="shmem_enabled grants transparent huge pages here: the pools take those first",
    ),
]


@pytest.fixture
def reserved() -> Iterator[None]:
    """PAGES hugetlb pages reserved above those that exist now, the host's number put back after."""
    before = NR_HUGEPAGES.read_text().strip()
    lines = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) for line in lines if line.startswith("HugePages_Total"))
    try:
        NR_HUGEPAGES.write_text(str(total + PAGES))
        if hugepages.read_host().hugetlb_free < PAGES:
            pytest.skip("the kernel could not reserve the pages (memory too fragmented)")
        yield
    finally:
        NR_HUGEPAGES.write_text(before)


def _hugetlb_bytes(pid: int) -> int:
    """Bytes of hugetlb pages mapped in that process (its pools), from its smaps."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line.startswith(("Shared_Hugetlb:", "Private_Hugetlb:")):
            total += int(line.split()[1]) * 1024
    return total


def test_a_restore_reads_into_hugetlb_pools_and_the_engine_reads_it_back(tmp_path: Path, reserved: None) -> None:
    def on_hugetlb(d: DaemonProc) -> None:
        assert "of it on huge pages (hugetlb)" in d.read_log()
        assert _hugetlb_bytes(d.proc.pid) >= hugepages.HUGE_PAGE

    through_disk(lambda: DaemonProc(tmp_path), on_hugetlb, PROFILE)
