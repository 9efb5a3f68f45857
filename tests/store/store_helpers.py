"""Shared helpers for the store tests: version keys, deterministic keys and payloads, real mounts."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xxhash

from kvtier.core import CacheForm, VersionKey
from kvtier.core.tier import ObjectKey

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
DIGEST = b"L" * 16
VK = VersionKey("ref-model", "w0", "abi-1", "comp-1", "idx-1", "fp8-packed")


def subprocess_env() -> dict[str, str]:
    """Environment for child Pythons: the checkout and these helpers importable, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, HERE, env.get("PYTHONPATH", "")) if p)
    return env


def make_key(ns: bytes, tag: str, group: str = "c4", form: CacheForm = CacheForm.COMPRESSED) -> ObjectKey:
    return ObjectKey(ns, xxhash.xxh3_128_digest(tag.encode()), group, form)


def make_payload(tag: str, nbytes: int) -> torch.Tensor:
    seed = xxhash.xxh3_64_intdigest(tag.encode())
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


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
