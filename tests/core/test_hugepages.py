"""How a shared pool gets large pages (kvtier.core.hugepages.shared_pages), decided from what the kernel says:
each case planted as the settings and /proc/meminfo text `read_host` reads."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from kvtier.core import hugepages as H

MIB = 1 << 20


def _host(tmp_path: Path, shmem: str | None, meminfo: str, *, collapses: bool = False) -> H.HostPages:
    """The host `read_host` reads from planted settings; `collapses`: what its MADV_COLLAPSE probe answers."""
    settings = tmp_path / "transparent_hugepage"
    settings.mkdir(exist_ok=True)
    if shmem is not None:
        words = ["always", "within_size", "advise", "never", "deny", "force"]
        (settings / "shmem_enabled").write_text(" ".join(f"[{w}]" if w == shmem else w for w in words) + "\n")
    (tmp_path / "meminfo").write_text(meminfo)
    return H.read_host(settings, tmp_path / "meminfo", lambda: collapses)


def _meminfo(free: int, rsvd: int = 0, size_kb: int = 2048) -> str:
    return (
        "MemTotal:       24000000 kB\nAnonHugePages:     14336 kB\nHugePages_Total:     600\n"
        f"HugePages_Free:      {free}\nHugePages_Rsvd:      {rsvd}\nHugePages_Surp:        0\n"
        f"Hugepagesize:       {size_kb} kB\nHugetlb:         1228800 kB\n"
    )


def test_read_host_takes_the_bracketed_word_and_the_free_unpromised_hugetlb_pages(tmp_path: Path) -> None:
    host = _host(tmp_path, "never", _meminfo(free=300, rsvd=20))
    assert host == H.HostPages("never", 280, 2 * MIB)


def test_what_cannot_be_read_counts_as_no_large_pages(tmp_path: Path) -> None:
    host = H.read_host(tmp_path / "no-such-dir", tmp_path / "no-meminfo", lambda: False)
    assert host == H.HostPages("absent", 0, 0)
    assert H.shared_pages(host, [64 * MIB]).how is H.SharedPages.SMALL


def test_shmem_thp_is_taken_where_the_setting_grants_it(tmp_path: Path) -> None:
    for word in ("advise", "within_size", "always", "force"):
        plan = H.shared_pages(_host(tmp_path, word, _meminfo(free=0)), [64 * MIB])
        assert plan.how is H.SharedPages.THP and f"shmem_enabled = {word}" in plan.why and plan.fix == ""


def test_stock_host_never_and_no_reserved_pages_is_small_pages_with_both_fixes(tmp_path: Path) -> None:
    plan = H.shared_pages(_host(tmp_path, "never", _meminfo(free=0)), [64 * MIB + 4096, 4 * MIB + 4096])
    assert plan.how is H.SharedPages.SMALL
    assert "shmem_enabled = never" in plan.why and "36 needed" in plan.why  # 33 + 3 pages, each pool rounded up
    assert "echo advise" in plan.fix and "vm.nr_hugepages by 36" in plan.fix


def test_reserved_hugetlb_pages_are_taken_only_where_they_cover_every_pool_whole(tmp_path: Path) -> None:
    sizes = [64 * MIB + 4096, 4 * MIB + 4096]  # 33 + 3 pages
    covered = H.shared_pages(_host(tmp_path, "never", _meminfo(free=36)), sizes)
    assert covered.how is H.SharedPages.HUGETLB and "cover 36" in covered.why
    short = H.shared_pages(_host(tmp_path, "never", _meminfo(free=40, rsvd=5)), sizes)  # 35 free, unpromised
    assert short.how is H.SharedPages.SMALL and "vm.nr_hugepages by 1" in short.fix
    # `deny` forbids transparent huge pages for shared memory; reserved hugetlb pages are another thing
    assert H.shared_pages(_host(tmp_path, "deny", _meminfo(free=36)), sizes).how is H.SharedPages.HUGETLB
    # a kernel without THP but with hugetlb pages of 1 GiB: one page covers a small pool
    giant = H.shared_pages(_host(tmp_path, None, _meminfo(free=1, size_kb=1 << 20)), [64 * MIB])
    assert giant.how is H.SharedPages.HUGETLB and "of 1024 MiB cover 1" in giant.why


def test_transparent_huge_pages_come_before_the_reserved_ones(tmp_path: Path) -> None:
    """Hugetlb pages set aside on a host may be meant for someone else: where shmem_enabled grants transparent huge
    pages, the pools take those and leave the reservation alone."""
    plan = H.shared_pages(_host(tmp_path, "advise", _meminfo(free=10_000)), [64 * MIB])
    assert plan.how is H.SharedPages.THP


def test_where_neither_is_given_pools_are_moved_onto_huge_pages_where_madv_collapse_does_it(tmp_path: Path) -> None:
    """A stock host (never, nothing reserved) whose kernel moves a memfd's pages onto huge pages on request: the
    pools take small pages and are moved; no fix to print. Reserved pages that cover them still come first."""
    plan = H.shared_pages(_host(tmp_path, "never", _meminfo(free=0), collapses=True), [64 * MIB])
    assert plan.how is H.SharedPages.COLLAPSE and "MADV_COLLAPSE" in plan.why and plan.fix == ""
    covered = H.shared_pages(_host(tmp_path, "never", _meminfo(free=40), collapses=True), [64 * MIB])
    assert covered.how is H.SharedPages.HUGETLB
    # pools under one huge page each have nothing to move: small pages, and the fix says how to get more
    tiny = H.shared_pages(_host(tmp_path, "never", _meminfo(free=0), collapses=True), [MIB, 64 * 1024])
    assert tiny.how is H.SharedPages.SMALL and tiny.fix


def test_the_collapse_probe_runs_only_where_shmem_enabled_grants_nothing(tmp_path: Path) -> None:
    asked: list[bool] = []

    def probe() -> bool:
        asked.append(True)
        return True

    settings = tmp_path / "transparent_hugepage"
    settings.mkdir()
    (settings / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    assert H.read_host(settings, tmp_path / "none", probe).collapse is False and not asked
    (settings / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    assert H.read_host(settings, tmp_path / "none", probe).collapse is True and asked


def test_the_probe_tells_what_this_kernel_does() -> None:
    """`collapse_works` on this host agrees with the kernel: where it says yes, a fresh 2 MiB-aligned memfd mapping
    asked to collapse is on a huge page afterwards (smaps); where no, madvise refused."""
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4 * MIB)
        buf = H.map_shared(fd, 4 * MIB)
        addr = ctypes.addressof(buf)
        assert addr % H.HUGE_PAGE == 0
        assert H.populate(addr, 4 * MIB)
        moved = H.collapse(addr, 4 * MIB)
        assert moved == H.collapse_works()
        assert H.huge_bytes([(addr, 4 * MIB)]) == (4 * MIB if moved else 0)
    finally:
        os.close(fd)
