"""The verifier's disk-busy probe (md-resync style): others' bytes on the store's disk make it busy, its own do
not, a disk without statistics never is; and the busy rate reaches a running verifier through config and SIGHUP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core import CacheForm
from kvtier.core.config import apply_reloadable, load_config
from kvtier.core.errors import ConfigError
from kvtier.store import DiskStore
from kvtier.verifier import verifier_status
from kvtier.verifier.busy import HOLD_S, OTHERS_BUSY_BYTES_PER_S, SAMPLE_S, DeviceActivity, disk_stat_file
from kvtier.verifier.settings import settings_from_config
from support.verifier_helpers import VK, populate, start_verifier, stop, wait_for

MB = 1 << 20


class _Disk:
    """A device stat file and a /proc/self/io file that the test writes, and the probe's clock."""

    def __init__(self, tmp_path: Path) -> None:
        self.stat, self.io = tmp_path / "stat", tmp_path / "io"
        self.dev_bytes = self.own_bytes = 0
        self.now = 100.0
        self.move(0, 0)

    def move(self, others: int, own: int, seconds: float = 0.0, own_on_disk: int | None = None) -> None:
        """/proc counts `own` bytes for this process; `others` + `own_on_disk` (default: `own`) reach the device;
        then `seconds` pass."""
        self.dev_bytes += others + (own if own_on_disk is None else own_on_disk)
        self.own_bytes += own
        half = self.dev_bytes // 512 // 2  # split between sectors read (field 3) and written (field 7)
        rest = self.dev_bytes // 512 - half
        self.stat.write_text(f"   10 0 {half} 5 20 0 {rest} 7 0 9 12 0 0 0 0 0 0\n")
        self.io.write_text(
            f"rchar: 1\nwchar: 2\nsyscr: 3\nsyscw: 4\nread_bytes: {self.own_bytes // 3}\n"
            f"write_bytes: {self.own_bytes - self.own_bytes // 3}\ncancelled_write_bytes: 0\n"
        )
        self.now += seconds

    def probe(self) -> DeviceActivity:
        return DeviceActivity(self.stat, proc_io=self.io, clock=lambda: self.now)


def test_others_bytes_make_the_disk_busy_and_its_own_do_not(tmp_path: Path) -> None:
    disk = _Disk(tmp_path)
    probe = disk.probe()
    assert probe.available and not probe.busy()
    disk.move(others=0, own=20 * MB, seconds=0.1)  # only this process read: not busy
    assert not probe.busy()
    below = int(OTHERS_BUSY_BYTES_PER_S * 0.1 * 0.8)
    disk.move(others=below, own=5 * MB, seconds=0.1)  # others' trickle (a journal commit): not busy
    assert not probe.busy()
    disk.move(others=2 * MB, own=5 * MB, seconds=0.1)  # a foreground reading 20 MB/s
    assert probe.busy()
    disk.move(others=0, own=0, seconds=HOLD_S / 2)  # held a while after the others' last bytes ...
    assert probe.busy()
    disk.move(others=0, own=0, seconds=HOLD_S)  # ... and no longer
    assert not probe.busy()


def test_it_samples_at_most_every_interval_and_answers_from_the_last_sample_between(tmp_path: Path) -> None:
    disk = _Disk(tmp_path)
    probe = disk.probe()
    disk.move(others=10 * MB, own=0, seconds=SAMPLE_S / 5)
    assert not probe.busy()  # too soon to sample: the files are not read again
    disk.move(others=0, own=0, seconds=SAMPLE_S)
    assert probe.busy()


def test_its_own_read_counted_before_the_disk_completes_it_is_carried_one_sample_only(tmp_path: Path) -> None:
    disk = _Disk(tmp_path)
    probe = disk.probe()
    disk.move(others=0, own=4 * MB, seconds=0.1, own_on_disk=0)  # /proc counts our read when it is issued ...
    assert not probe.busy()
    disk.move(others=0, own=0, seconds=0.1, own_on_disk=4 * MB)  # ... the device once done, a sample later: ours
    assert not probe.busy()
    disk.move(others=0, own=4 * MB, seconds=0.1, own_on_disk=0)  # bytes of ours that never reach the disk ...
    assert not probe.busy()
    disk.move(others=0, own=0, seconds=0.1)
    assert not probe.busy()
    disk.move(others=4 * MB, own=0, seconds=0.1)  # ... do not hide others' bytes two samples later
    assert probe.busy()


def test_without_disk_statistics_it_is_never_busy(tmp_path: Path) -> None:
    assert disk_stat_file(os.makedev(0, 42), tmp_path) is None  # tmpfs, overlayfs, btrfs: no block device
    assert disk_stat_file(os.makedev(8, 0), tmp_path) is None  # no such node (a container without /sys)
    for probe in (DeviceActivity(None), DeviceActivity(tmp_path / "missing")):
        assert not probe.available and not probe.busy()
    disk = _Disk(tmp_path)
    probe = DeviceActivity(disk.stat, proc_io=tmp_path / "no-proc-io", clock=lambda: disk.now)
    disk.move(others=100 * MB, own=0, seconds=1.0)
    assert not probe.available and not probe.busy()


def test_a_partition_is_measured_on_its_whole_disk(tmp_path: Path) -> None:
    part = tmp_path / "devices" / "sda" / "sda1"
    part.mkdir(parents=True)
    (part / "partition").write_text("1\n")
    (part / "stat").write_text("0 " * 17)
    (part.parent / "stat").write_text("0 " * 17)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "8:1").symlink_to(part)
    (tmp_path / "dev" / "8:0").symlink_to(part.parent)
    assert disk_stat_file(os.makedev(8, 1), tmp_path / "dev") == (part.parent / "stat").resolve()
    assert disk_stat_file(os.makedev(8, 0), tmp_path / "dev") == tmp_path / "dev" / "8:0" / "stat"


_READER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
while True:  # until killed: re-reads the whole file from the disk each pass
    os.lseek(fd, 0, os.SEEK_SET)
    while os.readv(fd, [buf]) > 0:
        pass
"""


def test_another_process_reading_the_real_disk_makes_it_busy(tmp_path: Path) -> None:
    if disk_stat_file(os.stat(tmp_path).st_dev) is None:
        pytest.skip(f"{tmp_path} is on no block device with statistics in /sys/dev/block (tmpfs, overlayfs, ...)")
    data = tmp_path / "data"
    with open(data, "wb") as f:
        f.write(os.urandom(MB) * 32)
        f.flush()
        os.fsync(f.fileno())
    probe = DeviceActivity.of_root(tmp_path)  # after our own writes reached the disk
    assert probe.available
    try:
        os.close(os.open(data, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: {exc}")
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(data)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(probe.busy, 30.0, reader, "the probe sees another process's O_DIRECT reads")
    finally:
        reader.kill()
        reader.wait()


def test_the_busy_rate_is_read_from_config_reloaded_and_checked(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.toml"
    f.write_text('[verifier]\nrate_bytes_per_s = "32MiB"\nbusy_rate_bytes_per_s = "2MiB"\n')
    cfg = load_config(f, env={}, uid=1000, cwd=tmp_path)
    assert cfg.verifier.busy_rate_bytes_per_s == 2 * MB
    assert settings_from_config(f).busy_rate_bytes_per_s == 2 * MB
    f.write_text('[verifier]\nbusy_rate_bytes_per_s = "3MiB"\n')
    assert (
        apply_reloadable(cfg, load_config(f, env={}, uid=1000, cwd=tmp_path)).verifier.busy_rate_bytes_per_s == 3 * MB
    )
    f.write_text("[verifier]\nbusy_rate_bytes_per_s = -1\n")
    with pytest.raises(ConfigError, match=r"verifier\.busy_rate_bytes_per_s"):
        load_config(f, env={}, uid=1000, cwd=tmp_path)


def test_a_running_verifier_takes_a_new_busy_rate_on_sighup_and_publishes_both_rates(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    populate(root, [(VK, "a", CacheForm.COMPRESSED, 5000)])
    config = tmp_path / "kvtier.toml"
    config.write_text('[verifier]\nrate_bytes_per_s = "32MiB"\nbusy_rate_bytes_per_s = "2MiB"\n')
    proc = start_verifier(root, "--config", str(config))

    def rates() -> tuple[int, int] | None:
        with DiskStore(root, readonly=True) as s:
            published = verifier_status(s)["settings"]
        return (published["rate_bytes_per_s"], published["busy_rate_bytes_per_s"]) if published else None

    try:
        wait_for(lambda: rates() == (32 * MB, 2 * MB), 30.0, proc, "the configured rates published")
        config.write_text('[verifier]\nrate_bytes_per_s = "32MiB"\nbusy_rate_bytes_per_s = "3MiB"\n')
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: rates() == (32 * MB, 3 * MB), 30.0, proc, "the reloaded busy rate published")
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
