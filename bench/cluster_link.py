"""Cross-node restore over a real, rate-shaped link: two network namespaces joined by a veth pair, `tc netem`
rate limits on both ends; prints one JSON object (also `bench/cluster.py --link`).

Namespace A holds the cluster (a Mooncake master and two holders) and node 1, which puts `--objects` objects
of `--object-bytes` (kvtier objects: header + payload, as the tier writes them). Namespace B is node 2: a
ClusterTier whose every byte comes across the veth, verified, against the same objects from a DiskStore on
node 2's own disk, read cold (page cache dropped) and warm. For each `--rates` entry the link is shaped,
one TCP stream measures it (`link_gbps`, A to B, in the same run), and node 2 restores:
`restore_MBps`, `ratio_to_link` = restore bits/s over link bits/s, `ratio_to_disk_cold` / `_warm`;
`shaped_ratio_to_link_min` is the least `ratio_to_link` of the shaped runs (an unshaped run's is not about a link).
Beside it, Mooncake's own figure, the baseline: `mooncake_raw_MBps`, raw `batch_get_into` of the same objects by a plain
Mooncake client on node 2 (no verification, no copy), `raw_ratio_to_link`, and `ratio_to_raw` (the tier over it):
which layer caps a restore, the link, Mooncake's transfer or kvtier's verify-and-copy.

Needs root, `ip` and `tc` (Debian iproute2), and Mooncake; otherwise it prints {"skipped": why}. The addresses
(10.233.40.1 and .2) exist only inside the two namespaces this script creates and deletes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # support.mooncake_loopback: where the master binary is

from bench.pagecache import dd_direct_s, drop_cache_tree  # noqa: E402

A_ADDR, B_ADDR = "10.233.40.1", "10.233.40.2"
MASTER_PORT, METADATA_PORT, ADMIN_PORT, LINK_PORT = 50051, 8080, 9003, 5201
DIGEST = b"L" * 16


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs ip and tc (Debian iproute2)"
    try:
        from mooncake import store  # noqa: F401
    except ImportError as exc:
        return f"Mooncake is not installed ({exc}): pip install 'kvtier[cluster]'"
    return None


class Link:
    """Two namespaces and a veth pair between them; deleted on close (which also ends their processes)."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.a, self.b = f"kvtbench-a-{tag}", f"kvtbench-b-{tag}"
        self.va, self.vb = f"kvta{tag}", f"kvtb{tag}"
        _run("ip", "netns", "add", self.a)
        _run("ip", "netns", "add", self.b)
        _run("ip", "link", "add", self.va, "netns", self.a, "type", "veth", "peer", "name", self.vb, "netns", self.b)
        for ns, dev, addr in ((self.a, self.va, A_ADDR), (self.b, self.vb, B_ADDR)):
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
        self.rate = ""
        self.shaper = ""

    def shape(self, gbit: float | None) -> None:
        """Rate-limit both ends (None: no qdisc, the veth as fast as the CPUs move it). `tc netem rate` where the
        kernel has sch_netem, else a token bucket (`tbf`, in every kernel config): `self.shaper` says which."""
        for ns, dev in ((self.a, self.va), (self.b, self.vb)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if gbit is None:
                continue
            rate = f"{int(gbit * 1000)}mbit"
            # netem: a queue deep enough for the rate (its default 1000 packets starves fast links)
            netem = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "rate", rate, "limit", "100000"]
            if subprocess.run(netem, capture_output=True).returncode == 0:
                self.shaper = "netem"
                continue
            burst = max(256 << 10, int(gbit * 1e9 / 8 / 250))  # 4 ms at the rate: above what one timer tick sends
            _run(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(burst),
                "latency",
                "50ms",
            )
            self.shaper = "tbf (no sch_netem in this kernel)"
        self.rate = "none" if gbit is None else f"{gbit:g} Gbit/s"
        if gbit is None:
            self.shaper = "none"

    def qdisc(self) -> str:
        return subprocess.run(
            ["tc", "-n", self.a, "qdisc", "show", "dev", self.va], capture_output=True, text=True
        ).stdout.strip()

    def spawn(self, ns: str, argv: list[str], log: pathlib.Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", **(env or {})},
                start_new_session=True,
            )

    def run(self, ns: str, argv: list[str], env: dict[str, str], timeout: float) -> dict:
        out = subprocess.run(
            ["ip", "netns", "exec", ns, *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", **env},
            timeout=timeout,
        )
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            raise SystemExit(f"bench/cluster_link: {argv[2:4]} in {ns} failed ({out.returncode}): {out.stderr[-2000:]}")
        return json.loads(lines[-1])

    def close(self) -> None:
        for ns in (self.a, self.b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _wait_port(link: Link, ns: str, port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    probe = f"import socket; socket.create_connection(('{A_ADDR}', {port}), timeout=0.5)"
    while subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"bench/cluster_link: port {port} in {ns} never opened")
        time.sleep(0.2)  # polling a real condition (the port)


@contextlib.contextmanager
def cluster_in_a(link: Link, tmp: pathlib.Path, segment_bytes: int) -> Iterator[None]:
    """A master (serving the metadata too) and two holders, all in namespace A on A_ADDR."""
    from support.mooncake_loopback import master_binary

    argv = [master_binary(), f"--rpc_address={A_ADDR}", f"--rpc_port={MASTER_PORT}", "--client_ttl=30"]
    argv += ["--default_kv_lease_ttl=5000", f"--metrics_host={A_ADDR}", f"--metrics_port={ADMIN_PORT}"]
    argv += ["--enable_http_metadata_server=true", f"--http_metadata_server_host={A_ADDR}"]
    argv += [f"--http_metadata_server_port={METADATA_PORT}"]
    procs = [link.spawn(link.a, argv, tmp / "master.log")]
    _wait_port(link, link.a, MASTER_PORT, procs[0])
    env = {"MC_TCP_BIND_ADDRESS": A_ADDR}
    for i in range(2):
        ready = tmp / f"holder{i}.ready"
        procs.append(
            link.spawn(
                link.a,
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "holder",
                    "--segment-bytes",
                    str(segment_bytes),
                    "--ready",
                    str(ready),
                ],
                tmp / f"holder{i}.log",
                env,
            )
        )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"bench/cluster_link: holder {i} did not start: {(tmp / f'holder{i}.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)  # polling a real condition (its ready file)
    try:
        yield
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def link_gbps(link: Link, nbytes: int) -> float:
    """One TCP stream A -> B across the veth, as shaped now; measured by the receiver."""
    recv = f"""
import socket, time, json
srv = socket.create_server(("{B_ADDR}", {LINK_PORT}))
print("listening", flush=True)
c, _ = srv.accept()
buf, got, t0 = bytearray(4 << 20), 0, None
while n := c.recv_into(buf):  # until the sender closes
    if t0 is None: t0 = time.perf_counter()
    got += n
print(json.dumps({{"gbps": got * 8 / (time.perf_counter() - t0) / 1e9}}))
"""
    send = f"""
import socket
s = socket.create_connection(("{B_ADDR}", {LINK_PORT}))
chunk = bytes(4 << 20)
for _ in range(max(1, {nbytes} // len(chunk))): s.sendall(chunk)
s.close()
"""
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", link.b, sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True
    )
    assert receiver.stdout is not None
    receiver.stdout.readline()  # listening
    subprocess.run(["ip", "netns", "exec", link.a, sys.executable, "-c", send], check=True, timeout=300)
    out, _ = receiver.communicate(timeout=300)
    return json.loads(out.strip().splitlines()[-1])["gbps"]


# ----------------------------------------------------------------------------- roles (run inside a namespace)


def _cfg(local: str):
    from kvtier.cluster import ClusterConfig

    return ClusterConfig(
        enabled=True,
        master=f"{A_ADDR}:{MASTER_PORT}",
        metadata=f"http://{A_ADDR}:{METADATA_PORT}/metadata",
        local_hostname=local,
        staging_bytes=64 << 20,
        transfer_buffer_bytes=64 << 20,
        lookup_timeout_s=5.0,
        load_timeout_s=120.0,
        put_timeout_s=120.0,
    )


def _objects(n: int, size: int):
    from kvtier.core import CacheForm, VersionKey
    from kvtier.core.tier import ObjectKey

    vk = VersionKey("bench-cluster-link", "w0", "abi-1", "comp-1", "idx-1", "fp8")
    g = torch.Generator().manual_seed(11)
    keys = [ObjectKey(vk.namespace, i.to_bytes(16, "big"), "c4", CacheForm.COMPRESSED) for i in range(n)]
    return vk, keys, [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def role_holder(args: argparse.Namespace) -> None:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        A_ADDR,
        f"http://{A_ADDR}:{METADATA_PORT}/metadata",
        args.segment_bytes,
        16 << 20,
        "tcp",
        "",
        f"{A_ADDR}:{MASTER_PORT}",
    )
    if rc != 0:
        sys.exit(f"holder: setup failed with code {rc}")
    pathlib.Path(args.ready).write_text("ready")
    while True:  # until the orchestrator kills it
        signal.pause()


def role_put(args: argparse.Namespace) -> None:
    from kvtier.cluster import ClusterTier

    _, keys, payloads = _objects(args.objects, args.object_bytes)
    tier = ClusterTier(_cfg(A_ADDR))
    t0 = time.perf_counter()
    tier.store_many(list(zip(keys, payloads, [DIGEST] * len(keys))))
    put_s = time.perf_counter() - t0
    tier.close()
    print(json.dumps({"put_s": put_s}))


def _timed_load(tier, keys, outs) -> float:
    from kvtier.core.tier import LoadRequest

    t0 = time.perf_counter()
    reasons = tier.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])
    elapsed = time.perf_counter() - t0
    if any(r.value for r in reasons):
        raise SystemExit(f"a load failed: {sorted({r.label for r in reasons})}")
    return elapsed


def raw_get_s(keys, object_bytes: int, repeat: int) -> float:
    """Mooncake's own figure, the baseline: the same objects (header + payload, as the tier stored them) fetched
    with raw `batch_get_into` into one registered buffer, in batches of the tier's size (half of its staging), no
    verification and no copy; one small get first connects to the holders. Best of `repeat`."""
    from mooncake.store import MooncakeDistributedStore

    from kvtier.cluster import header as H

    cfg = _cfg(B_ADDR)
    names = [H.object_name(cfg.key_prefix, k) for k in keys]
    each = H.HEADER_BYTES + object_bytes
    store = MooncakeDistributedStore()
    if store.setup(B_ADDR, cfg.metadata, 0, cfg.transfer_buffer_bytes, "tcp", "", cfg.master_address) != 0:
        raise SystemExit("bench/cluster_link: raw Mooncake client setup failed")
    buf = torch.empty(len(keys) * each, dtype=torch.uint8)
    if store.register_buffer(buf.data_ptr(), buf.numel()) != 0:
        raise SystemExit("bench/cluster_link: could not register the raw client's buffer")
    per = max(1, (cfg.staging_bytes // 2) // each)
    ptrs = [buf.data_ptr() + i * each for i in range(len(keys))]

    def fetch(lo: int, hi: int) -> None:
        codes = store.batch_get_into(names[lo:hi], ptrs[lo:hi], [each] * (hi - lo))
        if any(c != each for c in codes):
            raise SystemExit(f"bench/cluster_link: a raw get failed: {sorted(set(codes))}")

    fetch(0, 1)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for lo in range(0, len(keys), per):
            fetch(lo, min(len(keys), lo + per))
        best = min(best, time.perf_counter() - t0)
    store.close()
    return best


def resident_fraction(root: str) -> float:
    """Of the pages of the files under `root`, the fraction in this machine's page cache now (mmap + mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = cached = 0
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            size = os.path.getsize(path)
            if not size:
                continue
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), f"mmap {path}")
                try:
                    if libc.mincore(addr, size, vec) != 0:
                        raise OSError(ctypes.get_errno(), f"mincore {path}")
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
            total += pages
            cached += sum(v & 1 for v in vec)
    return cached / total if total else 0.0


def role_get(args: argparse.Namespace) -> None:
    """Node 2: restore every object from the cluster (across the link) through the tier, then Mooncake's raw gets
    of the same objects, then the same objects from its own disk, cold and warm.

    States, matched and said in the output: the cluster's objects live in the holders' RAM (Mooncake segments
    are memory: there is no colder state on that side), and a fresh client's first load also makes its
    connections to the holders (`cluster_first_s`); `cluster_s` is the best load of a client that has loaded
    before. The disk's cold read is the store as it runs (O_DIRECT where the filesystem takes it) with the
    page cache of its files dropped first and checked empty (`disk_cold_resident`); its warm read is the same
    store opened with buffered I/O after one read filled the page cache (`disk_warm_resident`): RAM against RAM.
    `device_direct_s` is `dd iflag=direct` of the same files: what the device itself gives a cold read (on a
    virtual disk the host's cache may serve it)."""
    from kvtier.cluster import ClusterTier
    from kvtier.store import DiskStore, StoreConfig

    vk, keys, payloads = _objects(args.objects, args.object_bytes)
    outs = [torch.empty_like(p) for p in payloads]
    tier = ClusterTier(_cfg(B_ADDR))
    cluster_first_s = _timed_load(tier, keys, outs)
    cluster_s = min(_timed_load(tier, keys, outs) for _ in range(args.repeat))
    ok = all(torch.equal(o, p) for o, p in zip(outs, payloads))
    tier.close()
    doc = {
        "cluster_first_s": cluster_first_s,
        "cluster_s": cluster_s,
        "bitwise": ok,
        "raw_s": raw_get_s(keys, args.object_bytes, args.repeat),
    }
    if args.disk:
        disk = DiskStore(args.disk, writer=True)
        disk.register_namespace(vk)
        if disk.has(keys[:1], [DIGEST])[0].value != 0:  # not there yet (the first rate's run)
            disk.store_many(list(zip(keys, payloads, [DIGEST] * len(keys))))
        cold, resident = [], []
        for _ in range(args.repeat):
            drop_cache_tree(disk.root)
            resident.append(resident_fraction(disk.root))
            cold.append(_timed_load(disk, keys, outs))
        doc.update(disk_cold_s=min(cold), disk_cold_resident=max(resident), disk_cold_io=disk.io_backend)
        root = disk.root
        disk.close()
        buffered = DiskStore(args.disk, StoreConfig(io_backend="buffered"), readonly=True)
        _timed_load(buffered, keys, outs)  # fills the page cache
        doc.update(
            disk_warm_resident=resident_fraction(root),
            disk_warm_s=min(_timed_load(buffered, keys, outs) for _ in range(args.repeat)),
            disk_warm_io=buffered.io_backend,
        )
        buffered.close()
        drop_cache_tree(root)
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".seg")]
        doc["device_direct_s"] = sum(dd_direct_s(f) for f in files) if files else None
    print(json.dumps(doc))


# ----------------------------------------------------------------------------- the orchestrator (root namespace)


def link_level(args: argparse.Namespace) -> dict:
    why = why_not()
    if why:
        return {"skipped": why}
    total = args.objects * args.object_bytes
    link = Link()
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-link-", dir="/var/tmp") as tmpdir:
            tmp = pathlib.Path(tmpdir)
            with cluster_in_a(link, tmp, total // 2 + (128 << 20)):
                common = ["--objects", str(args.objects), "--object-bytes", str(args.object_bytes)]
                put = link.run(
                    link.a, [sys.executable, __file__, "--role", "put", *common], {"MC_TCP_BIND_ADDRESS": A_ADDR}, 600
                )
                runs = []
                for rate in args.rates:
                    link.shape(None if rate == 0 else rate)
                    gbps = link_gbps(link, args.link_bytes)
                    got = link.run(
                        link.b,
                        [
                            sys.executable,
                            __file__,
                            "--role",
                            "get",
                            *common,
                            "--repeat",
                            str(args.repeat),
                            "--disk",
                            str(tmp / "disk"),
                        ],
                        {"MC_TCP_BIND_ADDRESS": B_ADDR},
                        900,
                    )
                    if not got["bitwise"]:
                        raise SystemExit("bench/cluster_link: node 2 restored other bytes than node 1 put")
                    restore_gbps = total * 8 / got["cluster_s"] / 1e9
                    raw_gbps = total * 8 / got["raw_s"] / 1e9
                    device = got["device_direct_s"]
                    runs.append(
                        {
                            "shaped": link.rate,
                            "shaper": link.shaper,
                            "qdisc": link.qdisc(),
                            "link_gbps": round(gbps, 3),
                            # the cluster side: holders' RAM; a warm client (best of --repeat) and a fresh one
                            "cluster_state": "holder RAM (Mooncake segments are memory), client warm",
                            "restore_MBps": round(total / got["cluster_s"] / 1e6, 1),
                            "restore_first_MBps": round(total / got["cluster_first_s"] / 1e6, 1),
                            "ratio_to_link": round(restore_gbps / gbps, 3),
                            "mooncake_raw_MBps": round(total / got["raw_s"] / 1e6, 1),
                            "raw_ratio_to_link": round(raw_gbps / gbps, 3),
                            "ratio_to_raw": round(restore_gbps / raw_gbps, 3),
                            # the disk side: cold = page cache dropped (resident fraction measured), the store's
                            # own I/O; warm = buffered reads with the files in the page cache (RAM, as the holders)
                            "disk_cold_state": f"page cache dropped, {got['disk_cold_io']} reads",
                            "disk_cold_resident": round(got["disk_cold_resident"], 3),
                            "disk_cold_MBps": round(total / got["disk_cold_s"] / 1e6, 1),
                            "disk_warm_state": f"files in the page cache, {got['disk_warm_io']} reads",
                            "disk_warm_resident": round(got["disk_warm_resident"], 3),
                            "disk_warm_MBps": round(total / got["disk_warm_s"] / 1e6, 1),
                            "device_direct_MBps": round(total / device / 1e6, 1) if device else None,
                            "ratio_to_disk_cold": round(got["disk_cold_s"] / got["cluster_s"], 3),
                            "ratio_to_disk_warm": round(got["disk_warm_s"] / got["cluster_s"], 3),
                        }
                    )
        shaped = [r["ratio_to_link"] for r in runs if r["shaper"] != "none"]
        return {
            "objects": args.objects,
            "object_bytes": args.object_bytes,
            "put_MBps": round(total / put["put_s"] / 1e6, 1),
            "runs": runs,
            # the acceptance line's figure: every shaped link's, the least (an unshaped veth is memory speed, and
            # what caps a restore across it is this machine's cores, which both ends and the cluster share)
            **({"shaped_ratio_to_link_min": min(shaped)} if shaped else {}),
            "note": "two network namespaces joined by a veth pair on one machine: the link is shaped by tc (the "
            "shaper says which qdisc), but both ends, the master and the holders share this machine's cores",
        }
    finally:
        link.close()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 0.0], help="Gbit/s to shape (0: unshaped).")
    ap.add_argument("--link-bytes", type=int, default=256 << 20, help="Bytes of the TCP stream measuring the link.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["holder", "put", "get"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ready", help=argparse.SUPPRESS)
    ap.add_argument("--disk", default="", help=argparse.SUPPRESS)
    ap.add_argument("--segment-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--objects", type=int, default=128)
    ap.add_argument("--object-bytes", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default="", help="Also write the report (with machine, date, commit) to this file.")
    add_args(ap)
    args = ap.parse_args()
    if args.role:
        {"holder": role_holder, "put": role_put, "get": role_get}[args.role](args)
        return
    doc = link_level(args)
    print(json.dumps(doc))
    if args.out and "skipped" not in doc:
        write_report(pathlib.Path(args.out), doc, " ".join(sys.argv[1:]))


def write_report(path: pathlib.Path, doc: dict, argv: str) -> None:
    """The run with where and when it ran (bench/run_all.py's machine facts), its figures under `cluster_link`.
    Not in run_all's report shape (no `sections`): bench/report.py's pages are built from run_all's reports."""
    sys.path.insert(0, str(REPO / "bench"))  # run_all imports its sibling report.py by name
    from bench.run_all import git_commit, machine

    report = {
        "bench": "cluster_link",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": git_commit(),
        "machine": machine("/var/tmp"),
        "argv": argv,
        "cluster_link": doc,
    }
    path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
