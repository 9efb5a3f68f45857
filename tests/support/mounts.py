"""Real, size-limited filesystems for disk-full and O_DIRECT tests (root only; skipped otherwise)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def mounted(kind: str, size_mib: int) -> Iterator[str]:
    """A real, size-limited filesystem: tmpfs, ramfs, or a loop-mounted ext4 image; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting {kind} needs root")
    work = tempfile.mkdtemp(prefix=f"kvtier-{kind}-")
    mnt = os.path.join(work, "mnt")
    os.mkdir(mnt)
    if kind == "ext4":
        img = os.path.join(work, "fs.img")
        with open(img, "wb") as f:
            f.truncate(size_mib << 20)
        mk = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", img], capture_output=True, text=True)
        if mk.returncode:
            shutil.rmtree(work)
            pytest.skip(f"mkfs.ext4 failed: {mk.stderr.strip()}")
        cmd = ["mount", "-o", "loop", img, mnt]
    else:
        cmd = ["mount", "-t", kind, "-o", f"size={size_mib}m", kind, mnt]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        shutil.rmtree(work)
        pytest.skip(f"cannot mount {kind} here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=True)
        shutil.rmtree(work)
