"""A real daemon on a host that gives shared memory no huge pages when it is faulted in but whose kernel moves it onto
them on request (MADV_COLLAPSE: a stock Debian host on Linux 6.1+): its pools serve at once on small pages, are moved
onto huge pages after start (its stats count down to 0 bytes moving, its smaps shows the huge pages, `kvtier status`
says so), and a restore reads into the moved pools and the engine reads the bytes back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core import hugepages
from kvtier.core.profile import load_profile
from kvtier.refmodel.demo import settle_pages
from support.daemon import DaemonProc, child_env
from support.workload import through_disk

PROFILE = load_profile("ref-tiny")
POOLS = 'compressed = "16MiB"\nindexer = "4MiB"\ntail = "16MiB"\nswa = "4MiB"\n'  # every group's pool 2 MiB or more

pytestmark = pytest.mark.skipif(
    hugepages.shared_pages(hugepages.read_host(), [4 << 20]).how is not hugepages.SharedPages.COLLAPSE,
    reason="this host gives shared memory huge pages another way, or MADV_COLLAPSE does not move it",
)


def _shmem_huge_bytes(pid: int) -> int:
    """Bytes of shared memory that process maps with huge pages (its pools), from its smaps."""
    lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith("ShmemPmdMapped:"))


def _status(sock: Path, *flags: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", "--socket", str(sock), *flags],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_pools_are_moved_onto_huge_pages_after_start_and_a_restore_reads_into_them(tmp_path: Path) -> None:
    def moved(d: DaemonProc) -> None:
        settle_pages(d.socket, timeout_s=120)
        pools = json.loads(_status(d.socket, "--json"))["profiles"][0]["pools"]
        assert {p["pages"] for p in pools.values()} == {"collapse"}
        assert all(p["moving_bytes"] == 0 for p in pools.values())
        assert _shmem_huge_bytes(d.proc.pid) >= sum(p["bytes"] for p in pools.values()) // 2
        assert "moved onto huge pages in" in d.read_log()
        text = _status(d.socket)
        assert "pages collapse" in text and "still being moved" not in text

    through_disk(lambda: DaemonProc(tmp_path, pools=POOLS), moved, PROFILE)
