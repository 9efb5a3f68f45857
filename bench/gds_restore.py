"""A cold restore from the disk store into device memory, next to the device's host-to-device copy rate and the
disk's own read rate, in one run; prints one JSON object. Issue 14's GDS benchmark.

On a CUDA host with KvikIO (`pip install -e '.[gpu]'`) the store takes the `gds` backend: each batch is written
from device memory (its extent staged on the device, device checksums computed there) and read back straight into
device targets (the pool memory a daemon's cuda slots are, `bench/slots.py`), checked on the device. Reported:

- `restore_GBps`: `load_into` of every object into device targets, `--batch` objects a call, page cache dropped
  before each round; the best of `--rounds` (`round_GBps`: each round);
- `h2d_GBps`: the same bytes, a batch at a time, copied from pinned host memory to the device (best of the
  rounds): the host-to-device limit;
- `disk_GBps`: `dd iflag=direct bs=4M` over the store's segment files, cold (best of the rounds; None where the
  filesystem refuses O_DIRECT);
- `restore_of_h2d`, `restore_of_disk`: the ratios; `io_backend` (`gds` where KvikIO did the device I/O;
  `odirect`: reads went through host memory), `kvikio_compat_mode` (where KvikIO ran: ON means it moved the bytes
  through host bounce buffers, with no cuFile / nvidia-fs on the host, so not GPUDirect), `device_checksums` (the
  records carry the device checksum), `bytes_equal` (every object read back in a last, untimed pass and compared
  with what was written).

`--device cpu` runs the same scenario into host memory on the POSIX path (no h2d figure): it checks the script
where there is no GPU. `--device cuda` without CUDA prints {"skipped": ...} and exits 0.

    python bench/gds_restore.py [--device cuda|cpu] [--objects N] [--size BYTES] [--batch B] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from pagecache import dd_direct_s, drop_cache_tree  # noqa: E402
from slots import slot_targets  # noqa: E402

from kvtier.core import CacheForm, Reason, VersionKey  # noqa: E402
from kvtier.core.tier import LoadRequest, ObjectKey  # noqa: E402
from kvtier.store import SEGMENTS_DIR, DiskStore, StoreConfig  # noqa: E402
from kvtier.store.record import Flags  # noqa: E402

GB = 1e9
VK = VersionKey("bench-gds", "w", "abi", "c", "i", "fp8")
DIGEST = b"G" * 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (the GDS path where KvikIO is installed) or cpu.")
    ap.add_argument("--objects", type=int, default=256)
    ap.add_argument("--size", type=int, default=4 << 20, help="Bytes an object (default 4 MiB).")
    ap.add_argument("--batch", type=int, default=32, help="Objects a store_many / load_into call.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp", help="Where the store is made (a real disk, not tmpfs).")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device here (--device cpu runs the scenario on the host)"}))
        return
    work = tempfile.mkdtemp(prefix="kvtier-gds-", dir=args.dir)
    try:
        print(json.dumps(measure(Path(work), device, args)))
    finally:
        shutil.rmtree(work)


def measure(work: Path, device: torch.device, args: argparse.Namespace) -> dict:
    n, size, batch = args.objects, args.size, args.batch
    keys = [ObjectKey(VK.namespace, xxhash.xxh3_128_digest(b"g%d" % i), "c4", CacheForm.COMPRESSED) for i in range(n)]
    generator = torch.Generator(device=device).manual_seed(14)
    payloads = torch.randint(0, 256, (n, size), dtype=torch.uint8, device=device, generator=generator)
    batches = [range(at, min(n, at + batch)) for at in range(0, n, batch)]
    root = work / "store"
    with DiskStore(str(root), StoreConfig(), writer=True) as store:
        store.register_namespace(VK)
        backend = store.io_backend
        _sync(device)  # the payloads are made before the timed writes, not inside the first
        t0 = time.perf_counter()
        for idx in batches:
            store.store_many([(keys[i], payloads[i], DIGEST) for i in idx])
        write_s = time.perf_counter() - t0
        flags = {info.entry.flags for info in store.iter_records(namespace=VK.namespace, limit=n)}
    targets = slot_targets([size] * batch, device)
    with DiskStore(str(root), StoreConfig()) as store:

        def restore() -> None:
            for idx in batches:
                reasons = store.load_into([LoadRequest(keys[i], targets[j], DIGEST) for j, i in enumerate(idx)])
                if any(r is not Reason.OK for r in reasons):
                    raise SystemExit(f"a load answered {sorted({r.label for r in reasons})}")

        rounds = [_cold(root, restore, device) for _ in range(args.rounds)]
        drop_cache_tree(root)
        equal = True
        for idx in batches:  # untimed: every object read back and compared
            store.load_into([LoadRequest(keys[i], targets[j], DIGEST) for j, i in enumerate(idx)])
            equal = equal and all(torch.equal(targets[j], payloads[i]) for j, i in enumerate(idx))
    total = n * size
    restore_gbps = total / min(rounds) / GB
    h2d = _h2d_gbps(payloads, batches, device, args.rounds)
    disk = None if backend == "buffered" else _disk_gbps(root / SEGMENTS_DIR, args.rounds)
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "io_backend": backend,
        "kvikio_compat_mode": _kvikio_mode() if backend == "gds" else None,
        "device_checksums": all(f & Flags.DEVSUM for f in flags),
        "objects": n,
        "object_bytes": size,
        "bytes": total,
        "batch": batch,
        "write_GBps": round(total / write_s / GB, 3),
        "restore_GBps": round(restore_gbps, 3),
        "round_GBps": [round(total / s / GB, 3) for s in rounds],
        "h2d_GBps": None if h2d is None else round(h2d, 3),
        "restore_of_h2d": None if h2d is None else round(restore_gbps / h2d, 3),
        "disk_GBps": None if disk is None else round(disk, 3),
        "restore_of_disk": None if disk is None else round(restore_gbps / disk, 3),
        "bytes_equal": equal,
    }


def _cold(root: Path, restore: Callable[[], None], device: torch.device) -> float:
    """Seconds one restore of everything takes with the store's files out of the page cache."""
    drop_cache_tree(root)
    t0 = time.perf_counter()
    restore()
    _sync(device)
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _h2d_gbps(payloads: torch.Tensor, batches: list[range], device: torch.device, rounds: int) -> float | None:
    """Pinned host memory to the device, a batch's bytes a copy: what a restore through host memory could reach."""
    if device.type != "cuda":
        return None
    host = payloads[: len(batches[0])].cpu().pin_memory()
    dst = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for idx in batches:
            dst[: len(idx)].copy_(host[: len(idx)], non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return payloads.numel() / best / GB


def _kvikio_mode() -> str:
    import kvikio.defaults  # the gds backend is chosen only where it imports

    return str(kvikio.defaults.compat_mode())


def _disk_gbps(segments: Path, rounds: int) -> float:
    """dd iflag=direct over every segment file, cold: the disk's own read rate for the same bytes."""
    files = sorted(segments.iterdir())
    nbytes = sum(f.stat().st_size for f in files)
    best = float("inf")
    for _ in range(rounds):
        drop_cache_tree(segments)
        best = min(best, sum(dd_direct_s(f) for f in files))
    return nbytes / best / GB


if __name__ == "__main__":
    main()
