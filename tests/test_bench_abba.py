"""bench/abba.py, the engine benches' round order and cold-read check, on real files on this disk.

The probe must be able to say `warm`: a file read back through the page cache is resident before the eviction
and reported so when its eviction is skipped; a file this process keeps mapped (as kvtier keeps its LMDB
index) is counted apart and does not make a round warm.
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import abba


def filesystem(path: Path) -> str:
    """The type of the filesystem `path` is on (the longest mount point above it in /proc/self/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, fstype = line.split()[:3]
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """A folder on a filesystem with a page cache in front of a disk (on tmpfs the cache is the storage)."""
    if filesystem(tmp_path) == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs: nothing can be evicted there; set TMPDIR to a disk")
    return tmp_path


def write(path: Path, nbytes: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(nbytes))
    path.read_bytes()  # through the page cache: resident now
    return path


def test_abba_alternates_which_side_goes_first() -> None:
    assert abba.abba("k", "b", 4) == ["k", "b", "b", "k", "k", "b", "b", "k"]
    assert abba.abba("k", "b", 3) == ["k", "b", "b", "k", "k", "b"]
    with pytest.raises(ValueError, match="rounds"):
        abba.abba("k", "b", 0)


def test_evict_leaves_both_sides_cold_and_the_probe_sees_pages(disk: Path) -> None:
    a = write(disk / "a" / "seg", 1 << 20)
    write(disk / "b" / "x" / "page", 256 << 10)
    assert abba.resident_bytes(a) > 0  # the probe sees what a buffered read left

    got = abba.evict({"a": [disk / "a"], "b": [disk / "b"]})

    assert got["a"] == {"cache": "cold", "resident_bytes": 0, "mapped_bytes": 0, "file_bytes": 1 << 20}
    assert got["b"] == {"cache": "cold", "resident_bytes": 0, "mapped_bytes": 0, "file_bytes": 256 << 10}
    a.read_bytes()
    assert abba.resident_bytes(a) == 1 << 20


def test_a_file_left_in_memory_makes_its_side_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "a" / "seg", 1 << 20)
    monkeypatch.setattr(abba, "drop_cache_tree", lambda folder: None)  # an eviction that did not happen

    got = abba.evict({"a": [tmp_path / "a"]})

    assert got["a"]["cache"] == "warm"
    assert got["a"]["resident_bytes"] == 1 << 20


def test_a_file_this_process_maps_is_counted_apart(disk: Path) -> None:
    index = write(disk / "a" / "index", 64 << 10)
    write(disk / "a" / "seg", 64 << 10)
    with open(index, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        assert view[:] == index.read_bytes()  # every page of the mapping touched

        got = abba.evict({"a": [disk / "a"]})

    assert got["a"]["cache"] == "cold"
    assert got["a"]["resident_bytes"] == 0
    assert got["a"]["mapped_bytes"] == 64 << 10


def test_spread_is_median_min_max_and_relative_range() -> None:
    assert abba.spread([2.0, 1.0, 4.0]) == {"median": 2.0, "min": 1.0, "max": 4.0, "spread": 1.5}


def test_overall_is_warm_when_either_side_was_warm_at_any_read() -> None:
    cold = {"cache": "cold"}
    assert abba.overall([{**cold, "other_side": None}, {**cold, "other_side": cold}]) == "cold"
    assert abba.overall([{**cold, "other_side": None}, {**cold, "other_side": {"cache": "warm"}}]) == "warm"
    assert abba.overall([{"cache": "warm", "other_side": cold}]) == "warm"
