"""What one background extent write does to the store's readers: written with one O_DIRECT write (how compaction
wrote its copies before) against in `BACKGROUND_WRITE_BYTES` pieces one after another (how it writes them now:
`kvtier.store.extent`). bench/verifier.py's `background_write` section; run alone it prints the same JSON object.

Reader threads (bench/verifier.py's) load random batches of records from a store continuously. Windows of
`--window-s` come in pairs, a quiet one and one at whose start a helper process (nice 19 and `SCHED_BATCH`, as the
verifier runs) appends one extent of `MAX_EXTENT_BYTES` to a file on the same filesystem and fdatasyncs it, as a
relocation's copies and their sync. Each pair's order alternates, and the side (`one_write`, `pieces`) alternates
ABBA over the pairs, `--windows` pairs a side. Per side: the p99 of the loads of its write windows over the p99 of
those of the quiet windows paired with them (`p99_over_quiet`, with `ci95`, its resampling interval), the loads'
max, and how long a write took the helper (`write_ms`, median). `pieces_over_one_write`: the two sides' p99s.

    python bench/background_write.py [--quick] [--windows N] [--window-s S]
"""

from __future__ import annotations

import argparse
import json
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
from kvtier.store.extent import BACKGROUND_WRITE_BYTES, MAX_EXTENT_BYTES

SIDES = ("one_write", "pieces")

# The helper: one line in (the piece size, 0 for one write), one line out (seconds the write and its sync took).
HELPER = r"""
import mmap, os, sys, time
os.nice(19)
os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
path, extent = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, extent)  # page aligned, as O_DIRECT needs
buf.write(os.urandom(extent))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
end = 0
for line in sys.stdin:
    piece = int(line) or extent
    t0 = time.perf_counter()
    for at in range(0, extent, piece):
        os.pwrite(fd, memoryview(buf)[at : at + piece], end + at)
    os.fdatasync(fd)
    end += extent
    print(time.perf_counter() - t0, flush=True)
"""


def measure(args: argparse.Namespace) -> dict:
    work = tempfile.mkdtemp(prefix="kvtier-bench-bgwrite-", dir=args.root)
    readers = helper = None
    try:
        root = os.path.join(work, "store")
        keys, payloads, _ = vb.build(root, args.records, args.size, 4 << 20)
        helper = subprocess.Popen(
            [sys.executable, "-c", HELPER, os.path.join(work, "extents.bin"), str(MAX_EXTENT_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=tied_env(os.environ),
        )
        assert helper.stdin is not None and helper.stdout is not None
        readers = vb.Readers(root, keys, payloads, args.readers, args.batch)
        readers.start()
        took: dict[str, list[float]] = {s: [] for s in SIDES}
        for pair in range(2 * args.windows):
            side = SIDES[(pair + pair // 2) % 2]  # ABBA over the pairs
            for label in (side, f"quiet_{side}") if pair % 2 == 0 else (f"quiet_{side}", side):
                start_window([readers], label)
                t0 = time.perf_counter()
                if label == side:
                    helper.stdin.write(f"{BACKGROUND_WRITE_BYTES if side == 'pieces' else 0}\n")
                    helper.stdin.flush()
                    took[side].append(float(helper.stdout.readline()))
                time.sleep(max(0.0, args.window_s - (time.perf_counter() - t0)))
        start_window([readers], None)
        readers.stop()
        out: dict = {
            "extent_bytes": MAX_EXTENT_BYTES,
            "piece_bytes": BACKGROUND_WRITE_BYTES,
            "windows": args.windows,
            "window_s": args.window_s,
            "readers": args.readers,
            "wrong_bytes": readers.wrong,
        }
        for side in SIDES:
            loads, quiet = readers.samples[side], readers.samples[f"quiet_{side}"]
            p99 = float(np.percentile([x for xs in loads for x in xs], 99))
            quiet_p99 = float(np.percentile([x for xs in quiet for x in xs], 99))
            out[side] = {
                "p99_ms": round(p99 * 1e3, 2),
                "quiet_p99_ms": round(quiet_p99 * 1e3, 2),
                "p99_over_quiet": round(p99 / quiet_p99, 3),
                "ci95": p99_ratio_interval(loads, quiet, 1000),
                "max_ms": round(max(x for xs in loads for x in xs) * 1e3, 1),
                "write_ms": round(float(np.median(took[side])) * 1e3, 1),
            }
        out["pieces_over_one_write"] = round(out["pieces"]["p99_ms"] / out["one_write"]["p99_ms"], 3)
        return out
    finally:
        if readers is not None:
            readers.stop()
            readers.store.close()
        if helper is not None:
            helper.kill()
            helper.wait()
        shutil.rmtree(work, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}windows", type=int, default=30, help="pairs of windows per side, in ABBA order")
    p.add_argument(f"--{prefix}window-s", type=float, default=0.2)
    p.add_argument(f"--{prefix}records", type=int, default=600)
    p.add_argument(f"--{prefix}size", type=int, default=60_000)
    p.add_argument(f"--{prefix}readers", type=int, default=4)
    p.add_argument(f"--{prefix}batch", type=int, default=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="where to build the store (default: the temp dir)")
    add_arguments(p)
    p.add_argument("--quick", action="store_true", help="small and short (the test suite's version)")
    if "--quick" in sys.argv[1:]:
        p.set_defaults(windows=4, records=120)
    print(json.dumps(measure(p.parse_args())))


if __name__ == "__main__":
    main()
