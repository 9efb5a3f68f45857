"""Interference: reader threads load records continuously while the verifier sweeps, evicts and compacts.

Windows alternate (ABBA) between the verifier running and the verifier frozen (SIGSTOP), so whatever else
the machine does lands on both sides; per side it reports load p50/p99 and the ratios, plus the ratio of the
medians of per-window p99s (robust to a burst of outside load landing in a few windows). Readers load only
pinned records (never evicted, but relocated by compaction) and check every byte: a wrong byte, an error,
or a miss for such a record is counted. Prints one JSON object.

    python bench/verifier.py [--quick] [--records N] [--size BYTES] [--readers R] [--windows W] [--until-worked]
                             [--window-s S] [--rate B/s]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
import xxhash

from kvtier.core import CacheForm, Reason, VersionKey
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DiskStore, StoreConfig
from kvtier.verifier import verifier_status

DIGEST = b"B" * 16
VK = VersionKey("bench-verifier", "w0", "abi", "comp", "idx", "fp8")
SETTLE_S = 0.02


def _payload(i: int, size: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8))


def build(root: str, n: int, size: int, segment_bytes: int) -> tuple[list[ObjectKey], list[torch.Tensor]]:
    """n records of three forms; every 4th is pinned (the readers' set); the budget forces evicting about half
    of the rest, which leaves segments half dead, so compaction relocates the pinned records under the readers."""
    hot_keys, hot_payloads = [], []
    with DiskStore(root, StoreConfig(segment_bytes=segment_bytes), writer=True) as s:
        ns = s.register_namespace(VK)
        forms = (CacheForm.COMPRESSED, CacheForm.SWA, CacheForm.INDEXER)
        keys = []
        for i in range(n):
            form = forms[i % 3]
            k = ObjectKey(ns, xxhash.xxh3_128_digest(f"r{i}".encode()), form.value[:8], form)
            s.store(k, _payload(i, size), DIGEST)
            keys.append(k)
            if i % 4 == 0:
                hot_keys.append(k)
                hot_payloads.append(_payload(i, size))
        s.pin(hot_keys, 3600.0)
        record_bytes = s.stats()["record_bytes"]
        s.set_limits(int(record_bytes * 0.6), {})
    return hot_keys, hot_payloads


class Readers:
    """Threads that load random batches of pinned records and time each load_into call."""

    def __init__(
        self, root: str, keys: list[ObjectKey], payloads: list[torch.Tensor], threads: int, batch: int
    ) -> None:
        self.store = DiskStore(root, StoreConfig(io_backend="odirect", atime_flush_s=1e12, io_threads=4))
        self.keys, self.payloads, self.batch = keys, payloads, batch
        self.label: str | None = None
        self.window = 0
        self.samples: dict[str, list[list[float]]] = {"with": [], "without": []}  # per window
        self.loads = self.wrong = self.misses = self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        outs = [torch.empty_like(self.payloads[0]) for _ in range(self.batch)]
        while not self._stop.is_set():
            picks = rng.sample(range(len(self.keys)), self.batch)
            label, window = self.label, self.window
            t0 = time.perf_counter()
            try:
                reasons = self.store.load_into([LoadRequest(self.keys[i], o, DIGEST) for i, o in zip(picks, outs)])
            except Exception:
                with self._lock:
                    self.errors += 1
                continue
            dt = time.perf_counter() - t0
            wrong = sum(
                1 for i, o, r in zip(picks, outs, reasons) if r is Reason.OK and not torch.equal(o, self.payloads[i])
            )
            misses = sum(1 for r in reasons if r is not Reason.OK)
            with self._lock:
                self.loads += 1
                self.wrong += wrong
                self.misses += misses
                if label is not None and (label, window) == (self.label, self.window):
                    self.samples[label][-1].append(dt)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.store.close()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e6 if xs else float("nan")


def _worked(actions: dict[str, int], records: int) -> bool:
    """The verifier did every kind of work the windows are meant to overlap: swept half, evicted, compacted,
    unlinked."""
    return (
        actions.get("verified", 0) >= records // 2
        and actions.get("evicted", 0) > 0
        and actions.get("relocated", 0) > 0
        and actions.get("segments_unlinked", 0) > 0
    )


def run(args: argparse.Namespace) -> dict:
    work = tempfile.mkdtemp(prefix="kvtier-bench-verifier-", dir=args.root)
    root = os.path.join(work, "store")
    proc = None
    try:
        keys, payloads = build(root, args.records, args.size, args.segment_bytes)
        readers = Readers(root, keys, payloads, args.readers, args.batch)
        cmd = [
            sys.executable,
            "-m",
            "kvtier.cli",
            "verifier",
            "run",
            "--store",
            root,
            "--rate",
            str(args.rate),
            "--sweep-interval",
            "0",
            "--maintenance-interval",
            "0.5",
            "--poll",
            "0.05",
            *args.verifier_arg,
        ]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 60
        while verifier_status(readers.store)["phase"] in ("never ran", "starting"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"verifier did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.02)
        readers.start()
        windows = 0
        while True:
            for label in ("without", "with", "with", "without"):  # ABBA: drift in outside load lands on both sides
                os.kill(proc.pid, signal.SIGCONT if label == "with" else signal.SIGSTOP)
                readers.label = None
                time.sleep(SETTLE_S)
                readers.samples[label].append([])
                readers.window += 1
                readers.label = label
                time.sleep(args.window_s)
                windows += 1
            actions = verifier_status(readers.store)["actions"]
            if windows >= args.windows and (
                not args.until_worked or _worked(actions, args.records) or windows >= 4 * args.windows
            ):
                break
        readers.label = None
        os.kill(proc.pid, signal.SIGCONT)
        readers.stop()
        w, wo = ([x for window in readers.samples[k] for x in window] for k in ("with", "without"))
        wp99, wop99 = (float(np.median([_pct(x, 99) for x in readers.samples[k] if x])) for k in ("with", "without"))
        out = {
            "records": args.records,
            "record_payload_bytes": args.size,
            "readers": args.readers,
            "batch": args.batch,
            "rate_bytes_per_s": args.rate,
            "windows": windows,
            "window_s": args.window_s,
            "without": {"p50_us": round(_pct(wo, 50), 1), "p99_us": round(_pct(wo, 99), 1), "loads": len(wo)},
            "with": {"p50_us": round(_pct(w, 50), 1), "p99_us": round(_pct(w, 99), 1), "loads": len(w)},
            "p50_ratio": round(_pct(w, 50) / _pct(wo, 50), 3),
            "p99_ratio": round(_pct(w, 99) / _pct(wo, 99), 3),
            "window_p99_median_ratio": round(wp99 / wop99, 3),
            "loads": readers.loads,
            "wrong_bytes": readers.wrong,
            "pinned_misses": readers.misses,
            "errors": readers.errors,
            "verifier_actions": actions,
        }
        return out
    finally:
        if proc is not None:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small and short (the test suite's version)")
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--size", type=int, default=60_000)
    p.add_argument("--segment-bytes", type=int, default=4 << 20)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--windows", type=int, default=40, help="at least this many windows, in ABBA groups of 4")
    p.add_argument(
        "--until-worked",
        action="store_true",
        help="add ABBA groups (up to 4x --windows) until the verifier has swept half, evicted, compacted and unlinked: "
        "a verifier at nice 19 on a busy machine may need longer than the windows give it",
    )
    p.add_argument("--window-s", type=float, default=0.5)
    p.add_argument("--rate", type=int, default=32 << 20)
    p.add_argument("--root", default=None, help="where to build the store (default: the temp dir)")
    p.add_argument(
        "--verifier-arg", action="append", default=[], help="extra argument for `kvtier verifier run` (repeat)"
    )
    args = p.parse_args()
    if args.quick:
        args.records, args.windows, args.window_s, args.segment_bytes, args.until_worked = 240, 24, 0.25, 2 << 20, True
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
