"""Interference: reader threads load records continuously while the verifier sweeps, evicts and compacts.

Windows alternate (ABBA) between the verifier running and the verifier frozen (SIGSTOP; a frozen window starts
once every verifier thread has stopped, so none of its I/O is still in flight), so whatever else the machine does
lands on both sides. Per side it reports load p50/p99 and their ratios (`p99_ratio`: the p99 of every 'with'
load over the p99 of every 'without' load), the ratio of the medians of per-window p99s, and `paired_p99_ratio`
(the geometric mean over ABBA groups of each group's own p99 ratio: outside load that covers a group weighs on
both its sides). `breakdown` says what the verifier did in the 'with' windows (CPU seconds, bytes it read and
wrote, its read rate against --rate) and the median window p99 of the windows in which it wrote against those
in which it only read. `--control` keeps the verifier frozen on both sides: its ratios are the noise floor of the
machine at the time, to quote beside a real run's. Readers load only pinned records (never evicted, but relocated
by compaction) and check every byte: a wrong byte, an error, or a miss for such a record is counted. Prints one
JSON object, which also holds `durable_offloads` (bench/verifier_offloads.py), `segment_delete`
(bench/segment_delete.py: the readers while one segment of the default size is deleted at once and in synced
steps) and `background_io` (bench/background_io.py: the readers beside one 8 MiB background read or write sent
at once and in pieces one after another), each of which also runs alone.

The readers keep the store's disk busy the whole time, so a running verifier sees other processes moving bytes on
it (`kvtier.verifier.busy`) and paces at `--busy-rate`, not `--rate`: `breakdown.verifier_read_MBps` shows which.
`--busy-rate` equal to `--rate` turns that pacing off, to measure what it buys.

    python bench/verifier.py [--quick] [--records N] [--size BYTES] [--readers R] [--windows W] [--until-worked]
                             [--window-s S] [--rate B/s] [--busy-rate B/s] [--control]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from kvtier.core import CacheForm, Reason, VersionKey
from kvtier.core.parent import tied_env
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DecisionServer, DiskStore, StoreConfig
from kvtier.verifier import VerifierSettings, verifier_status

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import background_io
import segment_delete
import verifier_offloads
from resample import p99_ratio_interval

DIGEST = b"B" * 16
VK = VersionKey("bench-verifier", "w0", "abi", "comp", "idx", "fp8")
SETTLE_S = 0.02
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True, slots=True)
class Activity:
    """What the verifier process did in one window: CPU seconds, and bytes it read from / wrote to the disk
    (/proc/<pid>/io: O_DIRECT reads count, page-cache hits do not)."""

    cpu_s: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0
    decisions: int = 0  # index changes of its that the applier (the daemon's part, here) committed

    @classmethod
    def of(cls, pid: int, decisions: int = 0) -> Activity:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/io") as f:
            io = {k: int(v) for k, v in (line.split(":") for line in f)}
        return cls((int(fields[11]) + int(fields[12])) / CLOCK_TICK, io["read_bytes"], io["write_bytes"], decisions)

    def __sub__(self, other: Activity) -> Activity:
        return Activity(
            self.cpu_s - other.cpu_s,
            self.read_bytes - other.read_bytes,
            self.write_bytes - other.write_bytes,
            self.decisions - other.decisions,
        )

    @property
    def wrote(self) -> bool:
        """Whether the window saw the verifier write: its own bytes (compaction copies) or its index changes."""
        return self.write_bytes > 0 or self.decisions > 0


def _payload(i: int, size: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8))


def build(root: str, n: int, size: int, segment_bytes: int) -> tuple[list[ObjectKey], list[torch.Tensor], int]:
    """n records of three forms; every 4th is pinned (the readers' set). Also returns a budget that, once set,
    forces evicting about half of the rest, which leaves segments half dead, so compaction relocates the pinned
    records. It is not set here: a verifier started on a store over its budget evicts and compacts in its first
    pass, before any reader runs."""
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
        budget = int(s.stats()["record_bytes"] * 0.6)
    return hot_keys, hot_payloads, budget


class Readers:
    """Threads that load random batches of pinned records and time each load_into call."""

    def __init__(
        self, root: str, keys: list[ObjectKey], payloads: list[torch.Tensor], threads: int, batch: int
    ) -> None:
        self.store = DiskStore(root, StoreConfig(io_backend="odirect", atime_flush_s=3600.0, io_threads=4))
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
        """Stop the threads; the store stays open for the applier, which commits into it until it stops."""
        self._stop.set()
        for t in self._threads:
            t.join()


def _paired_ratio(with_: list[list[float]], without: list[list[float]]) -> float:
    """The geometric mean over ABBA groups of p99(the group's two 'with' windows) / p99(its two 'without'
    windows): each group is compared with its own neighbours in time, so a burst of outside load that covers a
    group weighs on both sides of it, and every group counts (a verifier that stalls readers now and then moves it;
    a median would not)."""
    ratios = [
        _pct(with_[g] + with_[g + 1], 99) / _pct(without[g] + without[g + 1], 99)
        for g in range(0, min(len(with_), len(without)) - 1, 2)
        if with_[g] and with_[g + 1] and without[g] and without[g + 1]
    ]
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else float("nan")


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of `pid` has stopped. A thread in a disk read or an fsync stops only once that I/O is
    done, so a frozen window starts with none of the verifier's I/O still in flight (it would otherwise count
    against the frozen side)."""
    deadline = time.monotonic() + timeout_s
    task_dir = f"/proc/{pid}/task"
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that exited meanwhile
                continue
        if all(s in "tT" for s in states):
            return
        time.sleep(0.001)
    raise RuntimeError(f"verifier pid {pid} did not stop within {timeout_s}s")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e6 if xs else float("nan")


def p99_against(windows: list[list[float]], base_windows: list[list[float]], base: str) -> dict:
    """p99 and max (ms) of the calls timed in `windows`, the p99 of those in `base_windows` (`{base}_p99_ms`) and
    the one over the other (`p99_over_{base}`): a side of a part whose readers load beside something."""
    calls, base_calls = [x for xs in windows for x in xs], [x for xs in base_windows for x in xs]
    p99, base_p99 = float(np.percentile(calls, 99)), float(np.percentile(base_calls, 99))
    return {
        "p99_ms": round(p99 * 1e3, 2),
        "max_ms": round(max(calls) * 1e3, 1),
        f"{base}_p99_ms": round(base_p99 * 1e3, 2),
        f"p99_over_{base}": round(p99 / base_p99, 3),
    }


def _worked(actions: dict[str, int], records: int) -> bool:
    """The verifier did every kind of work the windows are meant to overlap: swept half, evicted, compacted,
    unlinked."""
    return (
        actions.get("verified", 0) >= records // 2
        and actions.get("evicted", 0) > 0
        and actions.get("relocated", 0) > 0
        and actions.get("segments_unlinked", 0) > 0
    )


def windows_p99_ratio(
    with_: list[list[float]], without: list[list[float]], activity: list[Activity], wrote: bool
) -> float | None:
    """The p99 of every load of the 'with' windows in which the verifier wrote (`wrote`), or only read, over the
    p99 of every 'without' load: what the readers feel while it writes, not averaged with the windows in which it
    only reads. Pooled loads, not a median of per-window p99s, which would drop the worst windows' tails."""
    w = [x for xs, a in zip(with_, activity) if a.wrote is wrote for x in xs]
    wo = [x for xs in without for x in xs]
    return round(_pct(w, 99) / _pct(wo, 99), 3) if w and wo else None


def windows_p99_ratio_interval(
    with_: list[list[float]], without: list[list[float]], activity: list[Activity], wrote: bool, draws: int = 1000
) -> list[float] | None:
    """The resampling interval (`resample.p99_ratio_interval`) of `windows_p99_ratio`: the 'with' windows in which
    the verifier wrote (`wrote`), or only read, against every 'without' window."""
    return p99_ratio_interval([xs for xs, a in zip(with_, activity) if a.wrote is wrote], without, draws)


def breakdown(windows: list[list[float]], activity: list[Activity], window_s: float) -> dict:
    """Where the verifier's cost lands: its CPU and disk I/O over the 'with' windows, and how many of them it
    wrote in (index commits, compaction copies, each with an fsync) or only read in (their p99 ratios are
    `writing_windows_p99_ratio` and `reading_only_windows_p99_ratio`)."""
    fields = ("cpu_s", "read_bytes", "write_bytes", "decisions")
    total = Activity(*(sum(getattr(a, f) for a in activity) for f in fields))
    out: dict[str, object] = {
        "verifier_cpu_s": round(total.cpu_s, 2),
        "verifier_read_MB": round(total.read_bytes / 1e6, 1),
        "verifier_read_MBps": round(total.read_bytes / 1e6 / (len(activity) * window_s), 1) if activity else 0.0,
        "verifier_write_MB": round(total.write_bytes / 1e6, 1),
        "index_changes_applied": total.decisions,
    }
    out["windows_writing"] = sum(1 for x, a in zip(windows, activity) if x and a.wrote)
    out["windows_reading_only"] = sum(1 for x, a in zip(windows, activity) if x and not a.wrote)
    return out


def run(args: argparse.Namespace) -> dict:
    work = tempfile.mkdtemp(prefix="kvtier-bench-verifier-", dir=args.root)
    root = os.path.join(work, "store")
    proc = server = readers = None
    try:
        keys, payloads, budget = build(root, args.records, args.size, args.segment_bytes)
        readers = Readers(root, keys, payloads, args.readers, args.batch)
        if not args.verifier_writes:  # as beside a daemon: this process commits the verifier's index changes
            server = DecisionServer(root, readers.store.apply_decision)
            server.start()
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
            "--busy-rate",
            str(args.busy_rate),
            "--sweep-interval",
            "0",
            "--maintenance-interval",
            "0.5",
            "--poll",
            "0.05",
            *args.verifier_arg,
        ]
        proc = subprocess.Popen(  # it ends with this bench, however the bench ends (`kvtier.core.parent`)
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=tied_env(os.environ),
        )
        deadline = time.monotonic() + 60
        while verifier_status(readers.store)["phase"] in ("never ran", "starting"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"verifier did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.02)
        readers.start()
        windows = 0
        activity: dict[str, list[Activity]] = {"with": [], "without": []}  # per window, beside readers.samples
        while True:
            if windows == 4:  # the budget between two groups, with the verifier stopped: what it evicts and
                readers.store.set_limits(budget, {})  # compacts, it does in the windows, beside the readers
            for label in ("without", "with", "with", "without"):  # ABBA: drift in outside load lands on both sides
                readers.label = None
                if label == "with" and not args.control:
                    os.kill(proc.pid, signal.SIGCONT)
                else:
                    os.kill(proc.pid, signal.SIGSTOP)
                    _wait_stopped(proc.pid)
                time.sleep(SETTLE_S)
                readers.samples[label].append([])
                readers.window += 1
                applied = lambda: server.applied if server is not None else 0  # noqa: E731
                before = Activity.of(proc.pid, applied())
                readers.label = label
                time.sleep(args.window_s)
                readers.label = None
                activity[label].append(Activity.of(proc.pid, applied()) - before)
                windows += 1
            actions = verifier_status(readers.store)["actions"]
            if windows >= args.windows and (
                not args.until_worked or _worked(actions, args.records) or windows >= 4 * args.windows
            ):
                break
        # The readers first: the low-priority verifier gets little CPU for its exit while they hold the CPUs. Then
        # the verifier, before the applier: its last decisions (sealing its segment) still find it.
        readers.stop()
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=60)
        applied = None
        if server is not None:
            applied = server.applied
            server.stop()
            server = None
        w, wo = ([x for window in readers.samples[k] for x in window] for k in ("with", "without"))
        wp99, wop99 = (float(np.median([_pct(x, 99) for x in readers.samples[k] if x])) for k in ("with", "without"))
        out = {
            "records": args.records,
            "record_payload_bytes": args.size,
            "readers": args.readers,
            "batch": args.batch,
            "rate_bytes_per_s": args.rate,
            "busy_rate_bytes_per_s": args.busy_rate,
            "windows": windows,
            "window_s": args.window_s,
            "without": {"p50_us": round(_pct(wo, 50), 1), "p99_us": round(_pct(wo, 99), 1), "loads": len(wo)},
            "with": {"p50_us": round(_pct(w, 50), 1), "p99_us": round(_pct(w, 99), 1), "loads": len(w)},
            "p50_ratio": round(_pct(w, 50) / _pct(wo, 50), 3),
            "p99_ratio": round(_pct(w, 99) / _pct(wo, 99), 3),
            "p99_ratio_ci95": p99_ratio_interval(readers.samples["with"], readers.samples["without"]),
            "window_p99_median_ratio": round(wp99 / wop99, 3),
            "paired_p99_ratio": round(_paired_ratio(readers.samples["with"], readers.samples["without"]), 3),
            "loads": readers.loads,
            "wrong_bytes": readers.wrong,
            "pinned_misses": readers.misses,
            "errors": readers.errors,
            "writing_windows_p99_ratio": windows_p99_ratio(
                readers.samples["with"], readers.samples["without"], activity["with"], True
            ),
            "writing_windows_p99_ratio_ci95": windows_p99_ratio_interval(
                readers.samples["with"], readers.samples["without"], activity["with"], True
            ),
            "reading_only_windows_p99_ratio": windows_p99_ratio(
                readers.samples["with"], readers.samples["without"], activity["with"], False
            ),
            "index_writer": "verifier" if args.verifier_writes else "applier (as the daemon)",
            "index_changes_applied": applied,  # over the whole run, by the applier (None: the verifier wrote them)
            "verifier_actions": actions,
            "breakdown": breakdown(readers.samples["with"], activity["with"], args.window_s),
        }
        return out
    finally:
        if proc is not None:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
            proc.wait(timeout=30)
        if server is not None:
            server.stop()
        if readers is not None:
            readers.store.close()  # after the applier, whose last decisions (the verifier's exit) commit into it
        shutil.rmtree(work, ignore_errors=True)


def add_reader_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The readers' store and threads, for a part whose readers load beside something (segment_delete,
    background_io)."""
    p.add_argument(f"--{prefix}records", type=int, default=600)
    p.add_argument(f"--{prefix}size", type=int, default=60_000)
    p.add_argument(f"--{prefix}readers", type=int, default=4)
    p.add_argument(f"--{prefix}batch", type=int, default=4)


def run_part_alone(
    doc: str, add_arguments: Callable[[argparse.ArgumentParser], None], measure: Callable[..., dict], quick: dict
) -> None:
    """A part run alone: its own options, --root, and --quick (`quick`: its defaults then); prints one JSON object."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--root", default=None, help="where to build the store (default: the temp dir)")
    add_arguments(p)
    p.add_argument("--quick", action="store_true", help="small and short (the test suite's version)")
    if "--quick" in sys.argv[1:]:
        p.set_defaults(**quick)
    print(json.dumps(measure(p.parse_args())))


def _part(args: argparse.Namespace, prefix: str) -> argparse.Namespace:
    """One part's own options (those named with `prefix`, without it), and where to build its store."""
    return argparse.Namespace(
        root=args.root, **{k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix)}
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small and short (the test suite's version)")
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--size", type=int, default=60_000)
    p.add_argument("--segment-bytes", type=int, default=4 << 20)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--windows", type=int, default=200, help="at least this many windows, in ABBA groups of 4")
    p.add_argument(
        "--until-worked",
        action="store_true",
        help="add ABBA groups (up to 4x --windows) until the verifier has swept half, evicted, compacted and unlinked: "
        "a verifier at nice 19 on a busy machine may need longer than the windows give it",
    )
    p.add_argument("--window-s", type=float, default=0.2)
    p.add_argument(
        "--control",
        action="store_true",
        help="keep the verifier frozen in the 'with' windows too: the ratios then show the statistic's noise floor",
    )
    p.add_argument("--rate", type=int, default=32 << 20)
    p.add_argument(
        "--busy-rate",
        type=int,
        default=VerifierSettings().busy_rate_bytes_per_s,
        help="the verifier's rate while others use the disk (the product default; --rate: no busy pacing)",
    )
    p.add_argument("--root", default=None, help="where to build the store (default: the temp dir)")
    p.add_argument(
        "--verifier-arg", action="append", default=[], help="extra argument for `kvtier verifier run` (repeat)"
    )
    p.add_argument(
        "--verifier-writes",
        action="store_true",
        help="no applier: the verifier commits its own index changes (as `kvtier verifier run` with no daemon)",
    )
    p.add_argument(
        "--only",
        choices=("reads", "offloads", "deletes", "background"),
        default=None,
        help="run one part (default: reads, then offloads, then deletes, then background)",
    )
    verifier_offloads.add_arguments(p, prefix="offload-")
    segment_delete.add_arguments(p, prefix="delete-")
    background_io.add_arguments(p, prefix="bgio-")
    quick = "--quick" in sys.argv[1:]
    if quick:  # its sizes are defaults: options given beside it still win
        p.set_defaults(records=240, windows=24, window_s=0.25, segment_bytes=2 << 20, until_worked=True)
        p.set_defaults(offload_windows=8, offload_window_s=1.0, offload_records=1200, offload_progress_s=30.0)
        p.set_defaults(**{f"delete_{k}": v for k, v in segment_delete.QUICK.items()})
        p.set_defaults(**{f"bgio_{k}": v for k, v in background_io.QUICK.items()})
    args = p.parse_args()
    args.until_worked &= not args.control  # a frozen verifier never works: the control runs its windows, no more
    out = run(args) if args.only in (None, "reads") else {}
    if args.only in (None, "offloads") and not args.control:
        out["durable_offloads"] = verifier_offloads.measure(_part(args, "offload_"))
    if args.only in (None, "deletes") and not args.control:
        out["segment_delete"] = segment_delete.measure(_part(args, "delete_"))
    if args.only in (None, "background") and not args.control:
        out["background_io"] = background_io.measure(_part(args, "bgio_"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
