"""Start-up phases of a restarted `kvtier serve` (issue 41); prints one JSON object.

A store of `--records` records of the ref-tiny profile (its namespace, groups, object sizes and layout digests,
written by the store's own writer, once: `--store DIR` keeps it for later runs) lies under a daemon with
ref-tiny pools. The daemon is started once, killed with SIGKILL (a crash), and started again `--repeat` times,
each timed from the spawn of the process to:

- `config_s`: its first stderr line (`kvtier serve: ... opening the store`): interpreter, imports, config, guards;
- `first_lookup_s`: the first lookup answered: an engine's store-backed lookup (`tier_has` of cached records,
  through `kvtier.client.TierClient`, polled from the spawn until the socket answers). The daemon serves it before
  torch is loaded and before its pools are allocated;
- `first_lookup_cpu_s`: the daemon's CPU seconds (user + system, all its threads: /proc/PID/stat) when that lookup
  was answered. Unlike the wall clock it does not grow with other processes' load, so it shows what the start
  itself costs on a busy machine; `ready_cpu_s` the same at READY=1 (torch and the pools included);
- `ready_s`: READY=1 on the notify socket (the pools allocated too);
- `first_pool_lookup_s`: kvtier's own client's first lookup (attach, which waits for the pools, + lookup).

`phases` are the daemon's own marks (`kvtier status --json`: daemon.startup), in seconds since its process
started: `imports` (the interpreter, kvtier's CLI and the daemon's server, without torch), `guards` (config
read, device and budgets checked), `daemon_imports` (the backend's modules: store, engine tier ops; no pools'
modules), `store_open` (store, index and engine tier ops ready), `listening`, `torch_loaded` (torch and the
pools' modules, imported behind serving), `pools_ready`.

The baseline is what the daemon no longer pays before it listens: `import torch` alone in a fresh interpreter,
its CPU seconds (`torch_import_cpu_s`, measured in the same run, once per start) beside `first_lookup_cpu_s`.

The bound the issue sets is `first_lookup_s` <= 2 s on a quiet machine; `load_avg_1m` (at the end, and per run at
its start) says how quiet it was.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvtier.client import Client, TierClient
from kvtier.core import load_profile
from kvtier.core.config import config_text
from kvtier.core.forms import Reason
from kvtier.core.hashing import block_hashes
from kvtier.core.parent import tied_env
from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore
from kvtier.wire import Connection, DaemonUnavailable


def config(d: Path, store: Path) -> str:
    """The daemon's config: cpu, ref-tiny, its socket under `d`, its store at `store`, no verifier, no metrics."""
    return config_text(
        {
            "device": "cpu",
            "profiles": ["ref-tiny"],
            "server.socket": d / "k.sock",
            "store.root": store,
            "verifier.mode": "off",
            "metrics.address": "",
        }
    )


def populate(root: Path, records: int) -> np.ndarray:
    """`records` objects of ref-tiny, spread over its groups, as consecutive blocks of one long prompt; the
    prompt's tokens (the first lookup asks for its start)."""
    profile = load_profile("ref-tiny")
    h = profile.hash_block_tokens
    groups = profile.groups
    blocks = -(-records // len(groups))
    tokens = np.random.default_rng(0).integers(0, 1000, blocks * h)
    hashes = block_hashes(profile.namespace, tokens, h)
    with DiskStore(str(root), writer=True) as store:
        store.register_namespace(profile.version)
        written = 0
        batch = []
        for b, hb in enumerate(hashes):
            for g in groups:
                if written == records:
                    break
                payload = torch.full((g.object_bytes(h),), b % 251, dtype=torch.uint8)
                batch.append((ObjectKey(profile.namespace, hb, g.name, g.form), payload, profile.layout(g).digest))
                written += 1
            if len(batch) >= 1024:
                store.store_many(batch)
                batch = []
        if batch:
            store.store_many(batch)
    return tokens


def start(d: Path) -> tuple[subprocess.Popen[str], socket.socket, float]:
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    (d / "n.sock").unlink(missing_ok=True)
    notify.bind(str(d / "n.sock"))
    # it exits if this bench dies, however (`kvtier.core.parent`)
    env = tied_env({k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "WATCHDOG_"))})
    env["NOTIFY_SOCKET"] = str(d / "n.sock")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(d / "k.toml")],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    return proc, notify, t0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far, all its threads (/proc/PID/stat utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def torch_import_cpu_s() -> float:
    """The baseline: CPU seconds of `import torch` in a fresh interpreter (the interpreter's start subtracted)."""

    def child_cpu(code: str) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", code], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    return child_cpu("import torch") - child_cpu("pass")


def tier_lookup(sock: Path, tokens: np.ndarray, t0: float, pid: int) -> tuple[float, float]:
    """Seconds from the spawn until an engine's lookup of four cached blocks (every group) is answered OK, and the
    daemon's CPU seconds then."""
    profile = load_profile("ref-tiny")
    h = profile.hash_block_tokens
    hashes = block_hashes(profile.namespace, tokens[: 4 * h], h)
    keys = [ObjectKey(profile.namespace, hb, g.name, g.form) for hb in hashes for g in profile.groups]
    digests = [profile.layout(g).digest for _ in hashes for g in profile.groups]
    groups = [(g.name, g.form) for g in profile.groups]
    deadline = t0 + 300
    while True:
        try:
            with TierClient(sock, profile.version, groups, 0, timeout_s=30.0, name="bench startup tier") as tier:
                reasons = tier.has(keys, digests)
                cpu = cpu_s(pid)  # before the connection closes: the daemon's work for the lookup is done
            break
        except DaemonUnavailable:  # not listening yet (its socket is made once the store is open)
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.005)  # polling interval of a real condition (the socket answering)
    took = time.perf_counter() - t0
    assert all(r is Reason.OK for r in reasons), reasons  # a hit on what the store holds, never a miss or wrong
    return took, cpu


def one_start(d: Path, tokens: np.ndarray) -> dict[str, float | dict[str, float]]:
    load = os.getloadavg()[0]
    proc, notify, t0 = start(d)
    try:
        return {"load_avg_1m": load, **timed_start(proc, notify, t0, d, tokens)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # the crash the next start recovers from
            proc.wait()
        notify.close()


def timed_start(
    proc: subprocess.Popen[str], notify: socket.socket, t0: float, d: Path, tokens: np.ndarray
) -> dict[str, float | dict[str, float]]:
    assert proc.stderr is not None
    proc.stderr.readline()  # "kvtier serve: ... opening the store"
    config_s = time.perf_counter() - t0
    first, first_cpu = tier_lookup(d / "k.sock", tokens, t0, proc.pid)
    notify.settimeout(300)
    while b"READY=1" not in notify.recv(4096).split(b"\n"):
        pass
    ready_s = time.perf_counter() - t0
    ready_cpu = cpu_s(proc.pid)
    with Client(d / "k.sock", name="bench startup") as c:
        c.attach("ref-tiny")
        c.release(c.lookup(tokens[: 4 * load_profile("ref-tiny").hash_block_tokens]))
    first_pool = time.perf_counter() - t0
    with Connection(d / "k.sock", name="bench startup") as conn:
        daemon = conn.stats().daemon
    phases = dict(daemon.startup) if daemon is not None else {}
    return {
        "config_s": config_s,
        "first_lookup_s": first,
        "first_lookup_cpu_s": first_cpu,
        "ready_s": ready_s,
        "ready_cpu_s": ready_cpu,
        "first_pool_lookup_s": first_pool,
        "phases": phases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--store", type=Path, help="keep the populated store here and reuse it on later runs")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="kvt-start-"))  # short: the socket path must fit AF_UNIX
    try:
        store = args.store or d / "store"
        (d / "k.toml").write_text(config(d, store))
        t = time.perf_counter()
        tokens_file = store.parent / f"{store.name}.tokens-{args.records}.npy"
        if args.store is not None and tokens_file.exists():
            tokens = np.load(tokens_file)  # built by an earlier run with the same --records
        else:
            tokens = populate(store, args.records)
            if args.store is not None:
                np.save(tokens_file, tokens)
        populate_s = time.perf_counter() - t
        one_start(d, tokens)  # the first start, then a crash: every timed start is a restart after one
        runs: list[dict[str, float | dict[str, float]]] = []
        for _ in range(args.repeat):
            runs.append(one_start(d, tokens))
            runs[-1]["torch_import_cpu_s"] = torch_import_cpu_s()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out = {
        "bench": "startup",
        "records": args.records,
        "populate_s": round(populate_s, 2),
        "load_avg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        **{
            f"{k}_median": round(statistics.median(r[k] for r in runs), 3)  # type: ignore[misc]
            for k in (
                "config_s",
                "first_lookup_s",
                "first_lookup_cpu_s",
                "ready_s",
                "ready_cpu_s",
                "first_pool_lookup_s",
                "torch_import_cpu_s",
            )
        },
        "first_lookup_s_max": round(max(r["first_lookup_s"] for r in runs), 3),  # type: ignore[type-var]
        "first_lookup_cpu_s_max": round(max(r["first_lookup_cpu_s"] for r in runs), 3),  # type: ignore[type-var]
        "bound_s": 2.0,
        "phases_median": {
            k: round(statistics.median(r["phases"][k] for r in runs), 3)  # type: ignore[index]
            for k in runs[0]["phases"]  # type: ignore[union-attr]
            if all(k in r["phases"] for r in runs)  # type: ignore[operator]
        },
        "runs": [{k: v if isinstance(v, dict) else round(v, 3) for k, v in r.items()} for r in runs],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
