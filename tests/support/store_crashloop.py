"""kill -9 crash loop for the store: a zygote forks writers, the driver kills them and checks every ack.

Run as a script it is the zygote: it imports torch and kvtier once, then per `run R` line on stdin forks a
writer child that opens the store (after the fork), stores records of round R, printing `try R I` before
and `ack R I` to stdout *after* each store() returns; `reap PID` waits for a killed child and prints `exit PID STATUS`.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback

import torch

from kvtier.core.tier import LoadRequest
from kvtier.store import DiskStore, StoreConfig
from support.store_helpers import DIGEST, VK, make_key, make_payload, subprocess_env

RECORDS_PER_ROUND = 40
SEGMENT_BYTES = 1 << 20


def record_size(r: int, i: int) -> int:
    return 1000 + (r * 7919 + i * 104729) % 90_000


def record_tag(r: int, i: int) -> str:
    return f"r{r}-i{i}"


def _writer(root: str, r: int) -> None:
    store = DiskStore(root, StoreConfig(segment_bytes=SEGMENT_BYTES, io_threads=2), writer=True)
    ns = store.register_namespace(VK)
    for i in range(RECORDS_PER_ROUND):
        os.write(1, f"try {r} {i}\n".encode())
        store.store(make_key(ns, record_tag(r, i)), make_payload(record_tag(r, i), record_size(r, i)), DIGEST)
        os.write(1, f"ack {r} {i}\n".encode())
    store.close()
    os.write(1, f"done {r}\n".encode())


def zygote_main(root: str) -> None:
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "run":
            gate_r, gate_w = os.pipe()  # the child starts only after "pid" is out, so it comes first
            pid = os.fork()
            if pid == 0:
                os.read(gate_r, 1)
                try:
                    _writer(root, int(arg))
                except BaseException:
                    traceback.print_exc()
                    os.write(1, f"fail {arg}\n".encode())
                os._exit(0)
            os.write(1, f"pid {pid}\n".encode())
            os.write(gate_w, b"g")
            os.close(gate_r)
            os.close(gate_w)
        elif cmd == "reap":
            _, status = os.waitpid(int(arg), 0)
            os.write(1, f"exit {arg} {status}\n".encode())


@dataclasses.dataclass
class LoopResult:
    kills: int
    acked: int
    orphan_rounds: int  # kills after which rebuild-index --dry-run found more orphaned bytes
    seconds: float


class Zygote:
    def __init__(self, root: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=subprocess_env(),
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(["eof"])

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next(self, timeout: float = 30.0) -> list[str]:
        msg = self.lines.get(timeout=timeout)
        if msg == ["eof"]:
            raise RuntimeError("zygote exited")
        return msg

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def check_store(root: str, acked: set[tuple[int, int]], attempted: set[tuple[int, int]]) -> None:
    """Every acknowledged record reads back exactly; nothing visible that was never attempted; no partial record."""
    with DiskStore(root) as s:
        ns = VK.namespace
        visible = set()
        for info in _all_records(s):
            assert info.entry is not None and info.entry.quarantine is None, f"bad index entry for {info.key}"
            visible.add(info.key)
        by_key = {make_key(ns, record_tag(r, i)): (r, i) for r, i in attempted}
        assert visible <= set(by_key), "a record nobody wrote is visible"
        want = [by_key[k] for k in visible] + [ri for ri in acked]
        keys = [make_key(ns, record_tag(r, i)) for r, i in want]
        outs = [torch.empty(record_size(r, i), dtype=torch.uint8) for r, i in want]
        for start in range(0, len(keys), 64):
            reasons = s.load_into(
                [LoadRequest(k, o, DIGEST) for k, o in zip(keys[start : start + 64], outs[start : start + 64])]
            )
            assert all(r.name == "OK" for r in reasons), f"acknowledged or visible record unreadable: {reasons}"
        for (r, i), out in zip(want, outs):
            assert torch.equal(out, make_payload(record_tag(r, i), record_size(r, i))), f"record {(r, i)} differs"


def _all_records(s: DiskStore):
    after = None
    while True:
        batch = s.iter_records(after=after, limit=256)
        yield from batch
        if len(batch) < 256:
            return
        after = batch[-1].key


def unreferenced_bytes_independent(root: str) -> int:
    """Segment bytes not referenced by the index, computed without rebuild-index."""
    seg_dir = os.path.join(root, "segments")
    total = sum(os.path.getsize(os.path.join(seg_dir, n)) for n in os.listdir(seg_dir) if n.endswith(".seg"))
    with DiskStore(root) as s:
        return total - sum(info.entry.record_len for info in _all_records(s))


def crash_loop(root: str, kills: int, seed: int = 0, check=check_store) -> LoopResult:
    from kvtier.store import rebuild_index

    rng = random.Random(seed)
    t0 = time.monotonic()
    acked: set[tuple[int, int]] = set()
    attempted: set[tuple[int, int]] = set()
    orphan_rounds, last_orphans, done = 0, 0, 0
    zyg = Zygote(root)
    try:
        for r in range(kills):
            attempted |= {(r, i) for i in range(RECORDS_PER_ROUND)}
            zyg.send(f"run {r}")
            kind, pid = zyg.next()
            assert kind == "pid"
            # Kill after a random number of acks: mostly inside the next store() at a random delay, sometimes between.
            wait_for, inside = rng.randrange(0, 6), rng.random() < 0.8
            seen = 0
            while seen < wait_for + inside:
                msg = zyg.next()
                if msg[0] == "fail":
                    raise AssertionError(f"writer of round {r} failed (traceback on stderr)")
                if msg[0] == "done":
                    done += 1
                    break
                if msg[0] == "ack":
                    acked.add((int(msg[1]), int(msg[2])))
                    seen += 1
                elif msg[0] == "try" and seen == wait_for:
                    seen += 1
            deadline = time.perf_counter() + rng.uniform(0, 0.003)
            while time.perf_counter() < deadline:  # jitter, not synchronisation: the kill point is random
                pass
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
            zyg.send(f"reap {pid}")
            while (msg := zyg.next())[0] != "exit":
                if msg[0] == "ack":
                    acked.add((int(msg[1]), int(msg[2])))
            check(root, acked, attempted)
            report = rebuild_index(root, dry_run=True)
            assert report.unreferenced_bytes == unreferenced_bytes_independent(root)
            assert report.missing_records == 0 and report.corrupt_extents == 0
            if report.orphan_bytes > last_orphans:
                orphan_rounds += 1
            last_orphans = report.orphan_bytes
    finally:
        zyg.close()
    return LoopResult(kills, len(acked), orphan_rounds, time.monotonic() - t0)


if __name__ == "__main__":
    zygote_main(sys.argv[1])
