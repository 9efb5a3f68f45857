"""Damage on disk, for the integrity tests: a flipped bit in a segment file, found by path or by index entry."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.store import IndexEntry
from kvtier.store.segments import SEGMENTS_DIR, segment_name


def segment_path(root: str | Path, seg_id: int) -> str:
    return os.path.join(root, SEGMENTS_DIR, segment_name(seg_id))


def flip_bit(path: str | Path, offset: int, bit: int) -> None:
    """Flip one bit of a file in place and fsync it (what a reader then gets is the damaged byte)."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ (1 << bit)]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def flip_payload_bit(root: str | Path, entry: IndexEntry, at: int, bit: int) -> None:
    """Flip one bit `at` bytes into a record's payload, in its segment file."""
    flip_bit(segment_path(root, entry.segment), entry.payload_offset + at, bit)
