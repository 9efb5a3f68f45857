"""Is anyone else using the store's disk? The verifier's md-resync-style probe (md's sync_speed_min/max).

Contract: `DeviceActivity.of_root(root).busy()` is True while processes other than this one move more than
`OTHERS_BUSY_BYTES_PER_S` to or from the block device that holds `root`, and for `HOLD_S` after; else False.
It samples at most every `SAMPLE_S` and answers from the last sample in between, so it may be called before
every read. Others' bytes are the device's sectors read and written (`/sys/dev/block/MAJ:MIN/stat`, fields 3
and 7 of the kernel's Documentation/block/stat.rst, always in 512-byte units) less this process's own
`read_bytes` + `write_bytes` (`/proc/self/io`, every thread of the process). Where the device has no stat file
(tmpfs, overlayfs, btrfs or zfs with major 0, a container without /sys) or /proc/self/io cannot be read,
`available` is False and `busy()` is always False: the verifier then paces at its full rate.

A store on a partition is measured on the whole disk, since the partitions of a disk share its queue. A
device-mapper volume (LVM, dm-crypt) is measured as that volume: other volumes on the same disk are not seen.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SECTOR_BYTES = 512  # stat.rst: the sector fields count 512-byte units whatever the device's block size
SAMPLE_S = 0.05  # at most this often: two small file reads per sample
# Others' traffic below this is background, not a foreground: the filesystem journal committing the verifier's own
# index writes (jbd2 writes them, so they count as another process's), a daemon's log lines, atime updates. Those
# are tens of KiB at a time; one KV load of one record is already tens of KiB to MiBs, so a reader loading
# continuously is far above it: this threshold is a few tens of KiB per sample.
OTHERS_BUSY_BYTES_PER_S = 1 << 20
# Foreground loads come in bursts (a request's prefetch, then compute): without a hold the verifier would resume its
# full rate in each gap and meet the next burst at it.
HOLD_S = 0.5
_UNREADABLE = (OSError, ValueError, KeyError, IndexError)  # a stat or io file missing, or not in the kernel's format


def disk_stat_file(dev: int, sys_dev_block: str | Path = "/sys/dev/block") -> Path | None:
    """The stat file of the disk that holds device `dev` (an `st_dev`); None where there is none (major 0: no block
    device behind the filesystem)."""
    if os.major(dev) == 0:
        return None
    node = Path(sys_dev_block) / f"{os.major(dev)}:{os.minor(dev)}"
    if (node / "partition").exists():  # a partition: its disk is the directory above it in sysfs
        node = node.resolve().parent
    stat = node / "stat"
    return stat if stat.is_file() else None


class DeviceActivity:
    """Others' bytes on one disk (its stat file, None: unknown), sampled at most every `sample_s`."""

    def __init__(
        self,
        stat_path: str | Path | None,
        *,
        proc_io: str | Path = "/proc/self/io",
        sample_s: float = SAMPLE_S,
        threshold_bytes_per_s: float = OTHERS_BUSY_BYTES_PER_S,
        hold_s: float = HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stat_path = None if stat_path is None else Path(stat_path)
        self.proc_io = Path(proc_io)
        self.sample_s, self.threshold, self.hold_s, self._clock = sample_s, threshold_bytes_per_s, hold_s, clock
        self._busy_until = float("-inf")
        self._pending = 0  # own bytes counted by /proc but not yet seen completed on the device
        try:
            self._last = (clock(), self._device_bytes(), self._own_bytes())
            self.available = True
        except _UNREADABLE:
            self.available = False

    @classmethod
    def of_root(cls, root: str | Path, sys_dev_block: str | Path = "/sys/dev/block") -> DeviceActivity:
        """The probe of the disk that holds `root`."""
        return cls(disk_stat_file(os.stat(root).st_dev, sys_dev_block))

    def _device_bytes(self) -> int:
        if self.stat_path is None:
            raise FileNotFoundError("no block device statistics")
        fields = self.stat_path.read_text().split()
        return (int(fields[2]) + int(fields[6])) * SECTOR_BYTES

    def _own_bytes(self) -> int:
        io = dict(line.split(":", 1) for line in self.proc_io.read_text().splitlines() if ":" in line)
        return int(io["read_bytes"]) + int(io["write_bytes"])

    def busy(self) -> bool:
        if not self.available:
            return False
        now = self._clock()
        last_at, last_dev, last_own = self._last
        if now - last_at >= self.sample_s:
            try:
                dev, own = self._device_bytes(), self._own_bytes()
            except _UNREADABLE:
                return False  # transient (a device going away): not evidence of a foreground
            own_delta = own - last_own
            # /proc counts a read when it is issued, the device when it completes: one of our reads that straddles a
            # sample would otherwise count as someone else's in the next one. Carry our bytes over by one sample only,
            # so bytes of ours that never reach the disk (a page rewritten before writeback) cannot hide others'.
            ours = self._pending + own_delta
            others = max(0, dev - last_dev - ours)
            self._pending = min(own_delta, max(0, ours - (dev - last_dev)))
            if others > self.threshold * (now - last_at):
                self._busy_until = now + self.hold_s
            self._last = (now, dev, own)
        return now < self._busy_until
