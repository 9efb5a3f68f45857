"""What one background read or write of `MAX_EXTENT_BYTES` does to the store's readers: sent at once (how the verifier
read and compaction wrote before: a large O_DIRECT read or write reaches the device as several requests together)
against in `BACKGROUND_IO_BYTES` pieces one after another (how a scan reads and compaction writes now:
`kvtier.store.extent`); and what one batch stored through the store's writer does to them, its extents written each
with one call (the store's default) against in pieces (`[store] write_piece_bytes` of `STORE_PIECE_BYTES`).
bench/verifier.py's `background_io` section; run alone it prints the same JSON object.

Reader threads (bench/verifier.py's) load random batches of records from a store continuously. Windows of `--window-s`
come in pairs, a quiet one and one at whose start a helper process does one I/O. The background helper (nice 19 and
`SCHED_BATCH`, as the verifier runs) works on a file on the same filesystem: a write appends an extent and fdatasyncs
it (a relocation's copies and their sync); a read reads as many bytes from a random place of a part written and synced
before the windows (a check's chunk). The store helper (normal priority, as the daemon's write-back and an engine's
durable offload run) is the writer of two stores of its own on the same filesystem, one per side, and stores one batch
of `STORE_OBJECTS` new objects of `STORE_OBJECT_BYTES` with `store_many`: extents of up to `MAX_EXTENT_BYTES` written
in parallel by `io_threads`, one fdatasync, one commit, as a write-back batch goes. Each pair's order alternates, and
the sides alternate ABBA over the pairs, `--windows` pairs a side. Per kind (`write`, `read`, `store`) and side
(`at_once`, `pieces`): the p99 of the loads of its I/O windows over the p99 of those of the quiet windows paired with
them (`p99_over_quiet`, with `ci95`, its resampling interval), the loads' max, and how long the I/O took the helper
(`io_ms`, median, a write's sync included); `pieces_over_at_once`: the two sides' p99s, and for `store`
`io_pieces_over_at_once`: the two sides' `io_ms` (what pieces cost the writer).

    python bench/background_io.py [--quick] [--windows N] [--window-s S]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import verifier as vb
from resample import p99_ratio_interval
from segment_delete import start_window

from kvtier.core.parent import tied_env
from kvtier.store.extent import BACKGROUND_IO_BYTES, MAX_EXTENT_BYTES

KINDS = ("write", "read", "store")
SIDES = ("at_once", "pieces")
READ_AREA = 8  # extents written and synced before the windows, for the reads
STORE_OBJECTS = 32  # a batch of the daemon's write-back (`persister.PERSIST_BATCH`) ...
STORE_OBJECT_BYTES = 1 << 20  # ... of objects this size: more extents than the writer has threads
STORE_PIECE_BYTES = BACKGROUND_IO_BYTES  # the store's `write_piece_bytes` on the pieces side (its default is 0)
QUICK = {"windows": 4, "records": 120}  # --quick's defaults, alone or as bench/verifier.py's part

# The helper: one line in (the kind, and the piece size or 0 for at once), one line out (seconds the I/O took).
HELPER = r"""
import mmap, os, random, sys, time
os.nice(19)
os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
path, extent, area = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = mmap.mmap(-1, extent)  # page aligned, as O_DIRECT needs
buf.write(os.urandom(extent))
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
for i in range(area):
    os.pwrite(fd, buf, i * extent)
os.fsync(fd)
end = area * extent
print("ready", flush=True)
for line in sys.stdin:
    kind, piece = line.split()
    piece = int(piece) or extent
    t0 = time.perf_counter()
    if kind == "write":
        for at in range(0, extent, piece):
            os.pwrite(fd, memoryview(buf)[at : at + piece], end + at)
        os.fdatasync(fd)
        end += extent
    else:
        start = random.randrange(area) * extent
        for at in range(0, extent, piece):
            os.preadv(fd, [memoryview(buf)[at : at + piece]], start + at)
    print(time.perf_counter() - t0, flush=True)
"""


# The store helper: the same protocol ("store", and the piece size or 0), the writer of one store per piece size.
STORE_HELPER = r"""
import os, sys, time
import torch
sys.path.insert(0, sys.argv[1])
import verifier as vb
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore, StoreConfig
root, objects, size, pieces = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), [int(p) for p in sys.argv[5:]]
stores = {p: DiskStore(os.path.join(root, str(p)), StoreConfig(write_piece_bytes=p), writer=True) for p in pieces}
ns = {p: s.register_namespace(vb.VK) for p, s in stores.items()}
payloads = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(objects)]
made = 0
print("ready", flush=True)
for line in sys.stdin:
    piece = int(line.split()[1])
    keys = [ObjectKey(ns[piece], (made + i).to_bytes(16, "little"), "bgio", CacheForm.SWA) for i in range(objects)]
    made += objects
    t0 = time.perf_counter()
    stores[piece].store_many([(k, p, vb.DIGEST) for k, p in zip(keys, payloads)])
    print(time.perf_counter() - t0, flush=True)
"""


def _start(args: list[str]) -> subprocess.Popen:
    helper = subprocess.Popen(
        [sys.executable, "-c", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=tied_env(os.environ),
    )
    assert helper.stdout is not None
    if helper.stdout.readline().strip() != "ready":
        helper.kill()
        raise RuntimeError("an I/O helper did not start")
    return helper


def _side(loads: list[list[float]], quiet: list[list[float]], took: list[float]) -> dict:
    return {
        **vb.p99_against(loads, quiet, "quiet"),
        "ci95": p99_ratio_interval(loads, quiet, 1000),
        "io_ms": round(float(np.median(took)) * 1e3, 1),
    }


def measure(args: argparse.Namespace) -> dict:
    work = tempfile.mkdtemp(prefix="kvtier-bench-bgio-", dir=args.root)
    readers = None
    helpers: dict[str, subprocess.Popen] = {}
    piece = {"write": BACKGROUND_IO_BYTES, "read": BACKGROUND_IO_BYTES, "store": STORE_PIECE_BYTES}
    try:
        root = os.path.join(work, "store")
        keys, payloads, _ = vb.build(root, args.records, args.size, 4 << 20)
        background = _start([HELPER, os.path.join(work, "io.bin"), str(MAX_EXTENT_BYTES), str(READ_AREA)])
        helpers = {"write": background, "read": background}
        here, stores = os.path.dirname(os.path.abspath(__file__)), os.path.join(work, "writer")
        helpers["store"] = _start(
            [STORE_HELPER, here, stores, str(STORE_OBJECTS), str(STORE_OBJECT_BYTES), "0", str(piece["store"])]
        )
        readers = vb.Readers(root, keys, payloads, args.readers, args.batch)
        readers.start()
        took: dict[tuple[str, str], list[float]] = {(k, s): [] for k in KINDS for s in SIDES}
        ways = list(took)
        order = ways + ways[::-1]  # ABCD DCBA: each way early and late in each round
        for pair in range(len(ways) * args.windows):
            kind, side = order[pair % len(order)]
            io, quiet = f"{kind}_{side}", f"quiet_{kind}_{side}"
            for label in (io, quiet) if pair % 2 == 0 else (quiet, io):
                start_window([readers], label)
                t0 = time.perf_counter()
                if label == io:
                    helper = helpers[kind]
                    assert helper.stdin is not None and helper.stdout is not None
                    helper.stdin.write(f"{kind} {piece[kind] if side == 'pieces' else 0}\n")
                    helper.stdin.flush()
                    took[kind, side].append(float(helper.stdout.readline()))
                time.sleep(max(0.0, args.window_s - (time.perf_counter() - t0)))
        start_window([readers], None)
        readers.stop()
        out: dict = {
            "extent_bytes": MAX_EXTENT_BYTES,
            "piece_bytes": BACKGROUND_IO_BYTES,
            "store_batch": {
                "objects": STORE_OBJECTS,
                "object_bytes": STORE_OBJECT_BYTES,
                "piece_bytes": STORE_PIECE_BYTES,
            },
            "windows": args.windows,
            "window_s": args.window_s,
            "readers": args.readers,
            "wrong_bytes": readers.wrong,
        }
        samples = readers.samples
        for kind in KINDS:
            sides = {s: _side(samples[f"{kind}_{s}"], samples[f"quiet_{kind}_{s}"], took[kind, s]) for s in SIDES}
            ratio = round(sides["pieces"]["p99_ms"] / sides["at_once"]["p99_ms"], 3)
            out[kind] = {**sides, "pieces_over_at_once": ratio}
        out["store"]["io_pieces_over_at_once"] = round(
            out["store"]["pieces"]["io_ms"] / out["store"]["at_once"]["io_ms"], 3
        )
        return out
    finally:
        if readers is not None:
            readers.stop()
            readers.store.close()
        for helper in set(helpers.values()):
            helper.kill()
            helper.wait()
        shutil.rmtree(work, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}windows", type=int, default=30, help="pairs of windows per side, in ABBA order")
    p.add_argument(f"--{prefix}window-s", type=float, default=0.2)
    vb.add_reader_arguments(p, prefix)


def main() -> None:
    vb.run_part_alone(__doc__, add_arguments, measure, QUICK)


if __name__ == "__main__":
    main()
