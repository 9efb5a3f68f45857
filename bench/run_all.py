"""Every kvtier benchmark in one run, each side by side with its baseline; prints a JSON report and a markdown table.

Runs the bench scripts as subprocesses (each prints one JSON object) on the same filesystem, one
after another, and collects them:

  restore   bench/restore.py   restore vs recompute on the reference model, 4K-64K tokens, via the daemon
  store     bench/store.py     disk store write / cold read vs raw dd O_DIRECT
  lookup    bench/lookup.py    lookup + validation vs a bare dict, 4K-1M tokens
  daemon    bench/daemon.py    socket lookup vs in-process, load via the daemon vs the store directly
  verifier  bench/verifier.py  reads with the verifier running vs not; durable offloads via the daemon with
                               the verifier stopped at random vs stopped between transactions
  peers     bench/peers.py     kvtier vs python-diskcache and LMCache's LocalDiskBackend on the same objects

The peers (diskcache, lmcache 0.5.6, matplotlib) live in their own venv, `bench/.venv-peers`, which this
script creates on first use (CPU torch 2.13.0 first, so LMCache cannot pull another torch); never in
the project's dependencies. Writes bench/results/latest.json and bench/results/restore_vs_recompute.png.

Usage: python bench/run_all.py [--quick] [--only SECTION ...] [--skip SECTION ...] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from kvtier.core import hugepages

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PEERS_VENV = BENCH / ".venv-peers"
TORCH = "torch==2.13.0"  # the CPU wheel; installed before LMCache so that it is never replaced
PEERS = ("lmcache==0.5.6", "diskcache", "matplotlib")
SECTIONS = ("restore", "store", "lookup", "daemon", "verifier", "peers")


# ----------------------------------------------------------------------------------------------- peers venv


def _pip(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], capture_output=True, text=True
    )


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line for line in text.strip().splitlines()[-lines:] if not line.startswith("WARNING: Location"))


def ensure_peers_venv(venv: Path = PEERS_VENV) -> dict:
    """Create or reuse the peers venv; returns what it holds and why anything is missing."""
    marker = venv / "kvtier-peers.json"
    wanted = {"torch": TORCH, "peers": list(PEERS)}
    if marker.exists() and json.loads(marker.read_text()).get("wanted") == wanted:
        return json.loads(marker.read_text())
    t0 = time.perf_counter()
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    state: dict = {"wanted": wanted, "missing": {}}
    res = _pip(venv, TORCH)
    if res.returncode:
        raise RuntimeError(f"cannot install {TORCH} into {venv}: {_tail(res.stderr)}")
    for pkg in PEERS:
        res = _pip(venv, pkg)
        if res.returncode:
            state["missing"][pkg.split("=")[0]] = f"pip install {pkg} failed: {_tail(res.stderr)}"
    res = _pip(venv, "-e", str(ROOT))  # kvtier and its runtime deps, for the kvtier side of bench/peers.py
    if res.returncode:
        raise RuntimeError(f"cannot install kvtier into {venv}: {_tail(res.stderr)}")
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import torch, json; print(json.dumps([torch.__version__, torch.version.cuda]))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    version, cuda = json.loads(probe.stdout)
    if cuda is not None or not version.startswith("2.13.0"):
        raise RuntimeError(
            f"the peers venv has torch {version} (cuda {cuda}), not the CPU {TORCH}: remove {venv} and rerun"
        )
    state.update(torch=version, setup_s=round(time.perf_counter() - t0, 1))
    marker.write_text(json.dumps(state))
    return state


# ----------------------------------------------------------------------------------------------- sections


def commands(args: argparse.Namespace, peers_python: str) -> dict[str, list[str]]:
    py = sys.executable
    quick = args.quick
    d = ["--dir", args.dir]
    return {
        # Three rounds where a figure is a best of rounds (restore, store, peers): on the shared 2-core VM a slow
        # spell can cover two rounds back to back (a 4K restore from the pool alone, which reads no disk, took twice
        # as long in both).
        "restore": [
            py,
            "bench/restore.py",
            *d,
            "--repeat",
            "1" if quick else "3",
            "--tokens",
            *(["4096", "8192", "16384"] if quick else ["4096", "8192", "16384", "32768", "65536"]),
        ],
        "store": [py, "bench/store.py", *d, "--gib", "0.25" if quick else "0.5", "--repeat", "1" if quick else "3"],
        "lookup": [
            py,
            "bench/lookup.py",
            "--tokens",
            "4096",
            "65536",
            *([] if quick else ["1048576"]),
            "--repeat",
            "50" if quick else "200",
        ],
        "daemon": [py, "bench/daemon.py", "--rounds", "2" if quick else "4"],
        "verifier": [py, "bench/verifier.py", *(["--quick"] if quick else [])],
        "peers": [
            peers_python,
            "bench/peers.py",
            *d,
            "--tokens",
            "16384" if quick else "65536",
            "--repeat",
            "1" if quick else "3",
        ],
    }


def run_section(name: str, cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"{name}: no result in {timeout:.0f} s"}, time.perf_counter() - t0
    took = time.perf_counter() - t0
    if res.returncode != 0:
        return {"error": f"{' '.join(cmd[1:])} exited {res.returncode}: {_tail(res.stderr)}"}, took
    try:
        return json.loads(res.stdout.strip().splitlines()[-1]), took
    except (json.JSONDecodeError, IndexError):
        return {"error": f"{name} printed no JSON object: {res.stdout[-300:]!r}"}, took


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def calibration() -> dict:
    """How fast this machine's CPU runs the two kinds of work the CPU-bound lines are made of: interpreted Python
    (a fixed loop, ns per iteration) and hashing (xxh3_128 over 64 MiB, GB/s); best of five each. Benchmarks in
    objects/s or us per object scale with the first: compare two reports' numbers only beside these."""
    import xxhash

    def loop() -> float:
        t0 = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i & 7
        return (time.perf_counter() - t0) / 1_000_000

    data = os.urandom(64 << 20)

    def hashing() -> float:
        t0 = time.perf_counter()
        xxhash.xxh3_128_digest(data)
        return time.perf_counter() - t0

    return {
        "python_loop_ns": round(min(loop() for _ in range(5)) * 1e9, 1),
        "xxh3_GBps": round(len(data) / min(hashing() for _ in range(5)) / 1e9, 2),
    }


def machine(dir_: str) -> dict:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem = next((int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:")), 0)
    fs = subprocess.run(["df", "--output=fstype,source", dir_], capture_output=True, text=True).stdout.split()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "calibration": calibration(),
        "memory_GiB": round(mem / (1 << 20), 1),
        "arch": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "bench_dir": dir_,
        "filesystem": " ".join(fs[2:4]) if len(fs) >= 4 else "unknown",
        # whether the daemon's cpu pools (shared memory) and the store's buffers can be on huge pages: it sets how
        # large the disk's read requests are (docs/systemd.md)
        "thp_shmem": hugepages.setting("shmem_enabled"),
        "thp_anon": hugepages.setting("enabled"),
    }


def git_commit() -> str:
    res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return res.stdout.strip() or "unknown"


# ----------------------------------------------------------------------------------------------- table


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"
    if unit == "ms":
        return f"{v:.3g} ms"
    return f"{v:,.0f} {unit}".strip()


def _speed(ratio: float) -> str:
    """kvtier's speed over the baseline's, as words."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def rows(sections: dict) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, kvtier, compared with, its value, ratio) per line of the table."""
    out: list[tuple[str, str, str, str, str]] = []
    r = sections.get("restore", {})
    for c in r.get("cases", []):
        hit = "" if c["hit_tokens"] == c["tokens"] else f" (hit {c['hit_tokens'] // 1024}K)"
        out.append(
            (
                f"restore {c['tokens'] // 1024}K-token prefix from disk via the daemon ({r['profile']}){hit}",
                _fmt(c["restore_s"], "s"),
                "recompute",
                _fmt(c["recompute_s"], "s"),
                f"{_speed(c['ratio'])}; whole request {_speed(c['request_ratio'])}",
            )
        )
    s = sections.get("store", {})
    if "write_MBps" in s:
        out.append(
            (
                "store write (durable), MB/s",
                _fmt(s["write_MBps"]),
                "dd oflag=direct",
                _fmt(s["raw_write_MBps"]),
                f"{s['write_ratio']:.2f} of raw",
            )
        )
        out.append(
            (
                "store cold read, MB/s",
                _fmt(s["read_MBps"]),
                "dd iflag=direct",
                _fmt(s["raw_read_MBps"]),
                f"{s['read_ratio']:.2f} of raw",
            )
        )
    for c in sections.get("lookup", {}).get("cases", []):
        out.append(
            (
                f"lookup {c['tokens'] // 1024}K tokens ({c['mix']})",
                _fmt(c["lookup_ms"], "ms"),
                "bare dict",
                _fmt(c["bare_ms"], "ms"),
                _speed(1 / c["ratio"]),
            )
        )
    dm = sections.get("daemon", {})
    if "lookup" in dm:
        lk, ld = dm["lookup"], dm["load"]
        out.append(
            (
                f"lookup over the socket p50, {lk['tokens'] // 1024}K tokens",
                _fmt(lk["p50_ms"], "ms"),
                "in process",
                _fmt(lk["inproc_p50_ms"], "ms"),
                _speed(1 / lk["ratio_p50"]),
            )
        )
        out.append(
            (
                "load via the daemon, MB/s",
                _fmt(ld["daemon_MBps"]),
                "store direct",
                _fmt(ld["direct_MBps"]),
                _speed(ld["ratio"]),
            )
        )
    rs = dm.get("dsv4_restore")
    if rs:
        out.append(
            (
                f"{rs['tokens'] // 1024}K-token {dm['profile']} prefix restored into the pool via the daemon, MB/s "
                f"(a daemon just started: {_fmt(rs['fresh_daemon_MBps'])})",
                _fmt(rs["MBps"]),
                "dd iflag=direct, same bytes",
                _fmt(rs["dd_MBps"]),
                f"{rs['ratio']:.2f} of raw",
            )
        )
    v = sections.get("verifier", {})
    if "pending" in v:
        out.append(("verifier interference", "pending", "", "", v["pending"]))
    elif "with" in v:
        for q in ("p50", "p99"):
            out.append(
                (
                    f"store load {q}, verifier sweeping/evicting/compacting",
                    f"{v['with'][f'{q}_us']:,.0f} µs",
                    "verifier stopped",
                    f"{v['without'][f'{q}_us']:,.0f} µs",
                    _speed(1 / v[f"{q}_ratio"]),
                )
            )
        if v.get("writing_windows_p99_ratio") is not None:
            out.append(
                (
                    "store load p99 in the windows in which the verifier wrote",
                    f"{v['writing_windows_p99_ratio'] * v['without']['p99_us']:,.0f} µs",
                    "verifier stopped",
                    f"{v['without']['p99_us']:,.0f} µs",
                    f"{v['writing_windows_p99_ratio']:.2f}x the stopped p99",
                )
            )
        bad = v["wrong_bytes"] + v["pinned_misses"] + v["errors"]
        out.append(("loads during verifier work: wrong / missing / errors", f"{bad} of {v['loads']:,}", "", "", ""))
    d = v.get("durable_offloads")
    if d and d.get("control", {}).get("n"):
        for q in ("p99", "max"):
            out.append(
                (
                    f"durable offload {q} via the daemon, verifier evicting and stopped at random, "
                    f"{d['cpu_hogs']} CPU hogs",
                    f"{d['stopping'][f'{q}_ms']:,.0f} ms",
                    "verifier stopped between transactions",
                    f"{d['control'][f'{q}_ms']:,.0f} ms",
                    f"{d[f'{q}_ratio']:.2f}x",
                )
            )
        out.append(
            (
                "objects acknowledged durable, lost after kill -9 of the daemon",
                f"{d['acknowledged_lost']} of {d['acknowledged_objects']:,}",
                "",
                "",
                "",
            )
        )
    p = sections.get("peers", {})
    ks = p.get("stores", {}).get("kvtier", {})
    for peer, ps in p.get("stores", {}).items():
        if peer == "kvtier" or "error" in ks:
            continue
        if "error" in ps:
            out.append((f"vs {peer}", "", peer, "error", ps["error"][:80]))
            continue
        ratio = p["kvtier_over_peer"][peer]
        for label, key in (
            ("same objects: write, acknowledged, MB/s", "write_ack_MBps"),
            ("same objects: write + fsync of its files, MB/s", "write_durable_MBps"),
            ("same objects: cold read, MB/s", "cold_read_MBps"),
        ):
            out.append((label, _fmt(ks[key]), peer, _fmt(ps[key]), _speed(ratio[key])))
        if "raw_device" in p:
            out.append(
                (
                    f"same objects: cold read over dd iflag=direct ({_fmt(p['raw_device']['dd_MBps'])} MB/s)",
                    f"{ks['cold_read_of_dd']:.2f}",
                    peer,
                    f"{ps['cold_read_of_dd']:.2f}",
                    "",
                )
            )
        out.append(("one byte of an object flipped", ks["flipped_byte"], peer, ps["flipped_byte"], ""))
        out.append(("object's file truncated", ks["truncated_file"], peer, ps["truncated_file"], ""))
        restart = (  # noqa: E731
            lambda x: (
                f"{x['correct']}/{x['untouched']} back, {x['found'] - x['correct']} wrong"
                if "error" not in x
                else x["error"]
            )
        )
        out.append(("new process on the same directory", restart(ks["restart"]), peer, restart(ps["restart"]), ""))
    for name, sec in sections.items():
        if "error" in sec:
            out.append((name, "error", "", "", sec["error"][:120]))
    return out


def markdown(report: dict) -> str:
    m = report["machine"]
    head = (
        f"kvtier benchmarks, {report['date']}, commit {report['commit']}: {m['cpus']}-core {m['arch']} VM, "
        f"{m['memory_GiB']:.0f} GiB, {m['filesystem']} under {m['bench_dir']}, "
        f"transparent huge pages: shmem_enabled={m.get('thp_shmem', '?')}, enabled={m.get('thp_anon', '?')}"
        f"{' (--quick)' if report['quick'] else ''}\n\n"
    )
    cal = m.get("calibration")
    if cal:
        head += (
            f"CPU: {m.get('cpu_model', '?')}; a Python loop takes {cal['python_loop_ns']} ns per iteration, xxh3 "
            f"hashes {cal['xxh3_GBps']} GB/s (compare objects/s and µs per object across reports beside these)\n\n"
        )
    workload = report["sections"].get("peers", {}).get("workload")
    if workload:
        head += (
            f"Peers hold the same objects: {workload['profile']} history of a "
            f"{workload['tokens'] // 1024}K-token prefix plus "
            f"state checkpoints, {workload['objects']} objects, {workload['bytes'] / 1e6:.0f} MB.\n\n"
        )
    lines = ["| benchmark | kvtier | compared with | its value | kvtier vs it |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(r)} |" for r in rows(report["sections"])]
    return head + "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- main


def save(report: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="Smaller sizes, fewer repeats, restore up to 16K tokens.")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="Run only these sections.")
    ap.add_argument("--skip", nargs="+", choices=SECTIONS, default=[], help="Leave these sections out.")
    ap.add_argument(
        "--dir", default=os.environ.get("KVTIER_BENCH_DIR", "/var/tmp"), help="Directory on the filesystem to measure."
    )
    ap.add_argument("--out", default=str(RESULTS), help="Where latest.json and restore_vs_recompute.png go.")
    ap.add_argument("--timeout", type=float, default=600, help="Seconds one section may take.")
    args = ap.parse_args()
    wanted = [s for s in (args.only or SECTIONS) if s not in args.skip]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVTIER_BENCH_DIR=args.dir)

    started = time.perf_counter()
    venv: dict = {}
    peers_python = str(PEERS_VENV / "bin" / "python")
    if {"peers", "restore"} & set(wanted):
        try:
            venv = ensure_peers_venv()
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            venv = {"error": str(exc)}
    cmds = commands(args, peers_python)
    if "peers" in wanted and "lmcache" in venv.get("missing", {}):
        cmds["peers"] += ["--stores", "kvtier", "diskcache"]

    sections: dict[str, dict] = {}
    durations: dict[str, float] = {}
    for name in wanted:
        if name == "verifier" and not (BENCH / "verifier.py").exists():
            sections[name] = {"pending": "bench/verifier.py has not landed yet (the verifier is being written)"}
            continue
        if name == "peers" and "error" in venv:
            sections[name] = {"error": f"no peers venv: {venv['error']}"}
            continue
        print(f"run_all: {name} ...", file=sys.stderr, flush=True)
        sections[name], took = run_section(name, cmds[name], args.timeout, env)
        durations[name] = round(took, 1)
    if "peers" in sections and venv.get("missing"):
        sections["peers"]["not_measured"] = venv["missing"]

    report = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "machine": machine(args.dir),
        "quick": args.quick,
        "peers_venv": {k: v for k, v in venv.items() if k != "wanted"},
        "sections": sections,
        "durations_s": {**durations, "total": round(time.perf_counter() - started, 1)},
    }
    save(report, out_dir / "latest.json")
    if "cases" in sections.get("restore", {}) and "error" not in venv:
        png = out_dir / "restore_vs_recompute.png"
        res = subprocess.run(
            [peers_python, str(BENCH / "plot.py"), str(out_dir / "latest.json"), str(png)],
            capture_output=True,
            text=True,
        )
        report["plot"] = png.name if res.returncode == 0 else f"error: {_tail(res.stderr)}"
        save(report, out_dir / "latest.json")
    print(json.dumps(report))
    print()
    print(markdown(report))


if __name__ == "__main__":
    main()
