"""What deleting one segment does to the store's readers: the file freed at once (`os.unlink`, how kvtier deleted a
segment before) against in synced steps (`kvtier.store.unlink_in_steps`: the cuts `try_unlink_segment` and the
cleaner's stray removal make now, then the unlink). bench/verifier.py's `segment_delete` section; run alone it
prints the same JSON object.

Reader threads (bench/verifier.py's) load random batches of records from a store on the same filesystem
continuously, and a writer thread stores `--write-size` records one after another in a store of its own, each
durable when `store()` returns (its fdatasync and synced commit: a durable offload's path). Per deletion: a file of
the store's default segment size (`StoreConfig().segment_bytes`: what a user's segments are) is written and synced
(calls meanwhile are not counted), the threads run `--settle-s` and then a `--base-s` window (the baseline), the
file is deleted and the filesystems synced (`os.sync`: the journal commit that frees its extents, which any
fdatasync on the filesystem would also force), and the threads run `--after-s` more. Deletions alternate ABBA
between the sides, `--repeat` of each. Per side: the p99 and max of the loads started from the deletion to the
end of its window (`p99_ms`, `max_ms`), the same of the baselines before them (`base_...`), `p99_over_base`, and
the same of the durable stores (`durable_stores`); how long a deletion took (`delete_s`) and the device's discard
requests it caused (`discards`, from the block device's stat file; null where the filesystem has no block
device). `in_steps_over_at_once` and `durable_stores_in_steps_over_at_once`: in_steps' p99 over at_once's.
`discard_mount` says whether the filesystem is mounted with online discard (where it is not, neither side frees
extents with a discard and the two should read alike).

    python bench/segment_delete.py [--quick] [--repeat N] [--file-bytes B]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import verifier as vb
from thp import block_device

from kvtier.core import CacheForm, VersionKey
from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore, StoreConfig, unlink_in_steps

SIDES = ("at_once", "in_steps")
WRITER_VK = VersionKey("bench-segment-delete", "w0", "abi", "comp", "idx", "fp8")
WRITE_PIECE = 64 << 20
# --quick's defaults, alone or as bench/verifier.py's part
QUICK = {"repeat": 1, "file_bytes": 64 << 20, "settle_s": 0.2, "base_s": 0.5, "after_s": 0.5, "records": 120}


def discard_mount(path: str) -> bool | None:
    """Whether the filesystem holding `path` is mounted with `discard` (None: not found in mountinfo)."""
    best: tuple[int, bool] | None = None
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mount_point, options = fields[4], fields[5].split(",")
            sep = fields.index("-")
            super_options = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
            inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
            if inside and (best is None or len(mount_point) >= best[0]):
                best = (len(mount_point), "discard" in options + super_options)
    return None if best is None else best[1]


def _discards(dev: Path | None) -> int | None:
    """Discard requests the block device has completed (Documentation/block/stat.rst); None without one."""
    if dev is None:
        return None
    fields = (dev / "stat").read_text().split()
    return int(fields[11]) if len(fields) > 11 else None


def _write(path: str, nbytes: int, piece: bytes) -> None:
    with open(path, "wb") as f:
        for _ in range(nbytes // len(piece)):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())


class DurableWriter:
    """A thread that stores one record after another in a store of its own on the same filesystem, each durable when
    `store()` returns (its fdatasync and a synced commit: a durable offload's path), and times each store under the
    label set when it began (bench/verifier.py's `Readers` do the same for loads)."""

    def __init__(self, root: str, size: int) -> None:
        self.store = DiskStore(root, StoreConfig(), writer=True)
        self.namespace = self.store.register_namespace(WRITER_VK)
        self.payload = torch.from_numpy(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8))
        self.label: str | None = None
        self.window = 0
        self.samples: dict[str, list[list[float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            label, window = self.label, self.window
            key = ObjectKey(self.namespace, xxhash.xxh3_128_digest(b"w%d" % n), "c4", CacheForm.COMPRESSED)
            t0 = time.perf_counter()
            self.store.store(key, self.payload, vb.DIGEST)
            dt = time.perf_counter() - t0
            n += 1
            if label is not None and (label, window) == (self.label, self.window):
                self.samples[label][-1].append(dt)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.store.close()


def start_window(timed: list, label: str | None) -> None:
    """Start a window named `label` for every timed thread (None: what they time from now on counts nowhere)."""
    for t in timed:
        if label is not None:
            t.samples.setdefault(label, []).append([])
        t.window += 1
        t.label = label


def _summary(samples: dict[str, list[list[float]]], side: str) -> dict:
    """p99 and max of one side's calls, and of the windows before its deletions."""
    base = [x for xs in samples[f"base_{side}"] for x in xs]
    return {
        **vb.p99_against(samples[side], samples[f"base_{side}"], "base"),
        "base_max_ms": round(max(base) * 1e3, 1),
        "calls": sum(map(len, samples[side])),
    }


def measure(args: argparse.Namespace) -> dict:
    work = tempfile.mkdtemp(prefix="kvtier-bench-segdel-", dir=args.root)
    readers = writer = None
    dev = block_device(Path(work))
    try:
        root = os.path.join(work, "store")
        keys, payloads, _ = vb.build(root, args.records, args.size, 4 << 20)
        readers = vb.Readers(root, keys, payloads, args.readers, args.batch)
        writer = DurableWriter(os.path.join(work, "durable"), args.write_size)
        timed = [readers, writer]
        readers.start()
        writer.start()
        piece = np.random.default_rng(0).integers(0, 256, min(WRITE_PIECE, args.file_bytes), np.uint8).tobytes()
        took: dict[str, list[float]] = {s: [] for s in SIDES}
        discards: dict[str, list[int]] = {s: [] for s in SIDES}
        for r in range(2 * args.repeat):
            side = SIDES[(r + r // 2) % 2]  # ABBA
            path = os.path.join(work, "segment.bin")
            _write(path, args.file_bytes, piece)
            time.sleep(args.settle_s)  # the write's own traffic out of the baseline (not a synchronisation)
            start_window(timed, f"base_{side}")
            time.sleep(args.base_s)
            start_window(timed, side)
            d0, t0 = _discards(dev), time.perf_counter()
            if side == "at_once":
                os.unlink(path)
            else:
                unlink_in_steps(path)
            os.sync()  # the journal commit that frees the extents (any fdatasync on the filesystem forces one)
            took[side].append(time.perf_counter() - t0)
            time.sleep(args.after_s)
            start_window(timed, None)  # the next file's write is no side's: its calls are counted nowhere
            d1 = _discards(dev)
            if d0 is not None and d1 is not None:
                discards[side].append(d1 - d0)
        readers.stop()
        writer.stop()
        out: dict = {
            "file_bytes": args.file_bytes,
            "default_segment_bytes": StoreConfig().segment_bytes,
            "discard_mount": discard_mount(work),
            "repeat": args.repeat,
            "readers": args.readers,
            "durable_write_bytes": args.write_size,
        }
        for side in SIDES:
            out[side] = {
                **_summary(readers.samples, side),
                "durable_stores": _summary(writer.samples, side),
                "delete_s": round(float(np.median(took[side])), 3),
                "discards": int(np.median(discards[side])) if discards[side] else None,
            }
        out["in_steps_over_at_once"] = round(out["in_steps"]["p99_ms"] / out["at_once"]["p99_ms"], 3)
        out["durable_stores_in_steps_over_at_once"] = round(
            out["in_steps"]["durable_stores"]["p99_ms"] / out["at_once"]["durable_stores"]["p99_ms"], 3
        )
        out["wrong_bytes"] = readers.wrong
        return out
    finally:
        if writer is not None:
            writer.stop()
        if readers is not None:
            readers.stop()
            readers.store.close()
        shutil.rmtree(work, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}repeat", type=int, default=4, help="deletions per side, in ABBA order")
    p.add_argument(f"--{prefix}file-bytes", type=int, default=StoreConfig().segment_bytes)
    p.add_argument(f"--{prefix}settle-s", type=float, default=2.0)
    p.add_argument(f"--{prefix}base-s", type=float, default=2.0)
    p.add_argument(f"--{prefix}after-s", type=float, default=1.5)
    vb.add_reader_arguments(p, prefix)
    p.add_argument(f"--{prefix}write-size", type=int, default=16 << 10, help="bytes of each durable store")


def main() -> None:
    vb.run_part_alone(__doc__, add_arguments, measure, QUICK)


if __name__ == "__main__":
    main()
