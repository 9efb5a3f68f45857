"""Real small filesystems: ENOSPC is StoreFull with nothing visible; O_DIRECT refusal falls back to buffered."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from kvtier.core import Reason
from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, StoreConfig, StoreError, StoreFull
from support.store_helpers import DIGEST, VK, make_key, make_payload, mounted

RECORD = 300_000


def _kernel_accepts_odirect(directory: str) -> bool:
    """Asked of the kernel directly, independent of the store: tmpfs accepts O_DIRECT since Linux 6.6."""
    path = os.path.join(directory, "probe")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.unlink(path)
    return True


def _load_ok(store: DiskStore, tags: list[str]) -> bool:
    ns = VK.namespace
    outs = [torch.empty(RECORD, dtype=torch.uint8) for _ in tags]
    reasons = store.load_into([LoadRequest(make_key(ns, t), o, DIGEST) for t, o in zip(tags, outs)])
    return reasons == [Reason.OK] * len(tags) and all(
        torch.equal(o, make_payload(t, RECORD)) for t, o in zip(tags, outs)
    )


@pytest.mark.parametrize("precheck", [False, True], ids=["enospc", "statvfs"])
@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_filling_the_disk_is_store_full_and_the_store_stays_readable(kind: str, precheck: bool) -> None:
    with mounted(kind, 8 if kind == "tmpfs" else 16) as mnt:
        root = os.path.join(mnt, "store")
        expected = "odirect" if kind == "ext4" or _kernel_accepts_odirect(mnt) else "buffered"
        cfg = StoreConfig(segment_bytes=2 << 20, min_free_bytes=(256 << 10) if precheck else None, io_threads=2)
        acked: list[str] = []
        with DiskStore(root, cfg, writer=True) as s:
            assert s.io_backend == expected
            ns = s.register_namespace(VK)
            for i in range(200):
                tag = f"{kind}-{i}"
                try:
                    s.store(make_key(ns, tag), make_payload(tag, RECORD), DIGEST)
                except StoreFull as exc:
                    assert exc.limit == "disk" and exc.code == "store_full"
                    assert ("bytes free" in str(exc)) == precheck  # the statvfs pre-check, or a real ENOSPC
                    refused = tag
                    break
                acked.append(tag)
            else:
                pytest.fail("the filesystem never filled")
            assert len(acked) >= 5
            assert s.has([make_key(ns, refused)], [DIGEST]) == [Reason.MISSING]
            assert _load_ok(s, acked)
            with pytest.raises(StoreFull):  # still full, still typed, still nothing visible
                s.store(make_key(ns, refused), make_payload(refused, RECORD), DIGEST)
            s.remove([make_key(ns, acked[0])])  # the index stays writable at ENOSPC
        with DiskStore(root) as s:
            assert s.has([make_key(VK.namespace, refused)], [DIGEST]) == [Reason.MISSING]
            assert _load_ok(s, acked[1:])
            assert s.stats()["records"] == len(acked) - 1


def test_filesystem_refusing_odirect_uses_buffered_io_and_says_so() -> None:
    with mounted("ramfs", 8) as mnt:
        assert not _kernel_accepts_odirect(mnt)
        root = os.path.join(mnt, "store")
        with pytest.raises(StoreError, match="refuses O_DIRECT"):
            DiskStore(root, StoreConfig(io_backend="odirect"), writer=True)
        with DiskStore(root, writer=True) as s:
            assert s.io_backend == "buffered" and s.stats()["io_backend"] == "buffered"
            ns = s.register_namespace(VK)
            for i in range(4):
                s.store(make_key(ns, f"r{i}"), make_payload(f"r{i}", RECORD), DIGEST)
        with DiskStore(root) as s:
            assert s.io_backend == "buffered"
            assert _load_ok(s, [f"r{i}" for i in range(4)])
