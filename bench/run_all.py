"""Every kvtier benchmark in one run, each side by side with its baseline; prints a JSON report and a markdown table.

Runs the bench scripts as subprocesses (each prints one JSON object) on the same filesystem, one
after another, and collects them:

  restore   bench/restore.py   restore vs recompute on the reference model, 4K-64K tokens, via the daemon
  store     bench/store.py     disk store write vs dd O_DIRECT, cold read vs fio (1 GiB, 3 rounds)
  lookup    bench/lookup.py    lookup + validation vs a bare dict, 4K-1M tokens
  daemon    bench/daemon.py    socket lookup vs in-process, load via the daemon vs the store directly
  verifier  bench/verifier.py  reads with the verifier running vs not; durable offloads via the daemon with
                               the verifier stopped at random vs stopped between transactions
  peers     bench/peers.py     kvtier vs python-diskcache and LMCache's LocalDiskBackend on the same objects
  cluster   bench/cluster_link.py  cross-node restore over a shaped veth link between two network namespaces
                               (root, iproute2 and Mooncake; otherwise the section says why it was skipped)
  vllm      bench/vllm_dsv4.py  DSV4 rows through kvtier's vLLM tier vs vLLM's own fs tier, ABBA, cold
  sglang    bench/sglang_hicache.py  DSV4 HiCache pages through kvtier vs SGLang's HiCacheFile, ABBA, cold

The disk's limit for the store's cold read and the daemon's DSV4 restore is fio at kvtier's request size and depth
(bench/fio_limit.py); where fio is not installed this script says so first and those lines have no limit.
Every acceptance line in bench/targets.toml is checked against the run and printed as met / missed / n/a, and
written into latest.json (`targets`). `--thp both` (root) runs the sections under shmem_enabled = never and
under advise, the host's setting restored after; by default they run under the host's setting, recorded.

The peers (diskcache, lmcache 0.5.6, matplotlib) live in their own venv, `bench/.venv-peers`, which this
script creates on first use (CPU torch 2.13.0 first, so LMCache cannot pull another torch; then every package
at the version bench/peers-constraints.txt pins); never in the project's dependencies. The engine sections run in
the engines' venvs, which their test scripts build and install kvtier into (`tests/vllm/run.sh`,
`tests/sglang/run.sh`; KVTIER_VLLM_VENV and KVTIER_SGLANG_VENV name others), with this checkout's kvtier first on
the path; where one is missing, its section says so. Writes
bench/results/latest.json and bench/results/restore_vs_recompute.png, then docs/benchmarks.md and the README's
key results from them (bench/report.py).

Usage: python bench/run_all.py [--quick] [--only SECTION ...] [--skip SECTION ...] [--dir DIR] [--thp host|both]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import fio_limit  # bench/fio_limit.py, beside this script
import report as report_page  # bench/report.py
import targets  # bench/targets.py

from kvtier.core import hugepages

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
PEERS_VENV = BENCH / ".venv-peers"
TORCH = "torch==2.13.0"  # the CPU wheel; installed before LMCache so that it is never replaced
PEERS = ("lmcache==0.5.6", "diskcache", "matplotlib")
# every package of the peers venv pinned: pip has nothing to choose, so it neither backtracks nor drifts
PEERS_CONSTRAINTS = BENCH / "peers-constraints.txt"
SECTIONS = ("restore", "store", "lookup", "daemon", "verifier", "peers", "cluster", "vllm", "sglang")
# an engine section's venv: the variable that names it, its default, what builds it (the engine's test script)
ENGINE_VENVS = {
    "vllm": ("KVTIER_VLLM_VENV", BENCH / ".venv-vllm", "tests/vllm/run.sh builds it"),
    "sglang": ("KVTIER_SGLANG_VENV", BENCH / ".venv-sglang", "tests/sglang/run.sh builds it"),
}
THP_SHMEM = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
BOTH = ("never", "advise")  # the distributions' default, and the setting that gives shared memory huge pages
QUIET_BUSY = 0.15  # the share of the CPUs other work may take when the run begins, for the run to count as quiet


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
    pins = hashlib.sha256(PEERS_CONSTRAINTS.read_bytes()).hexdigest()[:16]
    wanted = {"torch": TORCH, "peers": list(PEERS), "constraints": pins}
    if marker.exists() and json.loads(marker.read_text()).get("wanted") == wanted:
        return json.loads(marker.read_text())
    t0 = time.perf_counter()
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    state: dict = {"wanted": wanted, "missing": {}}
    res = _pip(venv, TORCH)
    if res.returncode:
        raise RuntimeError(f"cannot install {TORCH} into {venv}: {_tail(res.stderr)}")
    pinned = ("-c", str(PEERS_CONSTRAINTS))
    # the peers and kvtier (with its runtime deps, for the kvtier side of bench/peers.py) in one resolution; only
    # where that fails, one peer at a time, so that the peers which do install are measured and the others named
    res = _pip(venv, *pinned, *PEERS, "-e", str(ROOT))
    if res.returncode:
        for pkg in PEERS:
            res = _pip(venv, *pinned, pkg)
            if res.returncode:
                state["missing"][pkg.split("=")[0]] = f"pip install {pkg} failed: {_tail(res.stderr)}"
        res = _pip(venv, *pinned, "-e", str(ROOT))
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
        # (1 GiB a round, the size bench/store.py's target line asks for: a shorter read is one the disk's
        # hiccups move more)
        "store": [py, "bench/store.py", *d, "--gib", "0.25" if quick else "1", "--repeat", "1" if quick else "3"],
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
        "cluster": [py, "bench/cluster_link.py", *(["--rates", "1.0", "--objects", "64"] if quick else [])],
        "vllm": [
            str(engine_python("vllm")),
            "bench/vllm_dsv4.py",
            *(["--rows", "16", "--repeats", "3"] if quick else []),
        ],
        "sglang": [str(engine_python("sglang")), "bench/sglang_hicache.py", *(["--pages", "16"] if quick else [])],
    }


def engine_python(name: str) -> Path:
    """The python of an engine section's venv (ENGINE_VENVS)."""
    var, default, _ = ENGINE_VENVS[name]
    return Path(os.environ.get(var) or default) / "bin" / "python"


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


def busy_share(seconds: float = 2.0) -> float:
    """The share of all CPUs' time spent on anything but idle over `seconds`, from /proc/stat: what other work
    takes before the benchmarks start (they would compete with it)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields[:8]), idle

    total0, idle0 = sample()
    time.sleep(seconds)  # a measurement window, not a wait for a condition
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


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
        # how the daemon's cpu pools get large pages under that setting (kvtier.core.hugepages.shared_pages)
        "pool_pages": hugepages.shared_pages(hugepages.read_host(), [hugepages.HUGE_PAGE]).how.value,
        "fio": fio_limit.missing()
        or subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip(),
    }


def git_commit() -> str:
    res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return res.stdout.strip() or "unknown"


# ----------------------------------------------------------------------------------------------- main


def save(report: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def run_sections(
    wanted: list[str], cmds: dict[str, list[str]], venv: dict, args: argparse.Namespace, env: dict[str, str]
) -> tuple[dict[str, dict], dict[str, float]]:
    sections: dict[str, dict] = {}
    durations: dict[str, float] = {}
    for name in wanted:
        if name == "verifier" and not (BENCH / "verifier.py").exists():
            sections[name] = {"pending": "bench/verifier.py has not landed yet (the verifier is being written)"}
            continue
        if name == "peers" and "error" in venv:
            sections[name] = {"error": f"no peers venv: {venv['error']}"}
            continue
        if name in ENGINE_VENVS and not engine_python(name).exists():
            sections[name] = {"pending": f"no {name} venv at {engine_python(name).parents[1]}: {ENGINE_VENVS[name][2]}"}
            continue
        print(f"run_all: {name} ...", file=sys.stderr, flush=True)
        sections[name], took = run_section(name, cmds[name], args.timeout, env)
        durations[name] = round(took, 1)
    if "peers" in sections and venv.get("missing"):
        sections["peers"]["not_measured"] = venv["missing"]
    return sections, durations


def thp_settings(mode: str) -> list[str | None]:
    """The shmem_enabled settings to run under: None is the host's own, left as it is."""
    if mode == "host":
        return [None]
    if os.geteuid() != 0 or not THP_SHMEM.exists():
        raise SystemExit(
            f"run_all: --thp both needs root and {THP_SHMEM} (it sets shmem_enabled to never, then advise, and "
            "restores it): run it as root, or without --thp to measure under the host's setting"
        )
    return list(BOTH)


def check_targets(sections: dict, mach: dict, label: str) -> list[dict]:
    """Every line of bench/targets.toml against these sections, printed as met / missed / n/a."""
    verdicts = targets.evaluate(targets.load(), sections, mach)
    print(f"run_all: targets{label}:", file=sys.stderr)
    for v in verdicts:
        print(f"  {targets.line(v)}", file=sys.stderr)
    return targets.as_json(verdicts)


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
    ap.add_argument(
        "--thp",
        choices=("host", "both"),
        default="host",
        help="host: run under the host's shmem_enabled; both (root): under never, then advise, the host's restored.",
    )
    args = ap.parse_args()
    wanted = [s for s in (args.only or SECTIONS) if s not in args.skip]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVTIER_BENCH_DIR=args.dir)
    settings = thp_settings(args.thp)
    no_fio = fio_limit.missing()
    if no_fio and {"store", "daemon"} & set(wanted):
        print(f"run_all: {no_fio}. The store's cold read and the DSV4 restore get no disk limit.", file=sys.stderr)

    started = time.perf_counter()
    busy = busy_share()
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

    host_thp = hugepages.setting("shmem_enabled")
    runs: list[dict] = []
    try:
        for setting in settings:
            if setting is not None:
                THP_SHMEM.write_text(setting)
                print(f"run_all: shmem_enabled = {setting}", file=sys.stderr)
            sections, durations = run_sections(wanted, cmds, venv, args, env)
            runs.append(
                {"thp_shmem": hugepages.setting("shmem_enabled"), "sections": sections, "durations_s": durations}
            )
    finally:
        if hugepages.setting("shmem_enabled") != host_thp:
            THP_SHMEM.write_text(host_thp)
    mach = {**machine(args.dir), "busy_before": round(busy, 3), "quiet": busy <= QUIET_BUSY}
    for run in runs:
        label = f" (shmem_enabled = {run['thp_shmem']})" if len(runs) > 1 else ""
        run["targets"] = check_targets(run["sections"], mach, label)
    # the table of record: the run under the host's own setting (under --thp both, the one of the two it matches,
    # else the distributions' default)
    main_run = next((r for r in runs if r["thp_shmem"] == host_thp), runs[0])
    report = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "machine": {**mach, "thp_shmem": main_run["thp_shmem"], "thp_shmem_host": host_thp},
        "quick": args.quick,
        "peers_venv": {k: v for k, v in venv.items() if k != "wanted"},
        "sections": main_run["sections"],
        "targets": main_run["targets"],
        "durations_s": {**main_run["durations_s"], "total": round(time.perf_counter() - started, 1)},
    }
    if len(runs) > 1:
        report["thp_runs"] = runs
    save(report, out_dir / "latest.json")
    sections = main_run["sections"]
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
    print(report_page.markdown(report))
    if out_dir.resolve() == RESULTS:  # the committed results: the pages generated from them follow
        for path in report_page.write():
            print(f"run_all: wrote {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
