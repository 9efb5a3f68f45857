"""Daemon overheads, side by side in one run; prints one JSON object.

- lookup: round trip of `Client.lookup` over the unix socket (p50 / p99) for a resident prefix, next
  to the same lookup on an in-process `CacheManager` holding the same blocks (ratio = socket / in-process).
- load: recovering objects from the disk store into the pool through the daemon (`Client.load`, timed without
  the lookup), next to `DiskStore.load_into` of exactly the same objects into tensors in this process, in the
  same round, ABBA order. Three prefixes are loaded in turn into pools that hold one, so every daemon load reads
  the whole prefix from disk; the store reads with O_DIRECT where the filesystem allows (cold either way).
  Direct loads go into page-aligned tensors, as the daemon's pool slots are. `ratio` is the median of the
  rounds' daemon / direct throughput ratios (`round_ratios`), `daemon_MBps` and `direct_MBps` each side's
  total.
- dsv4_restore: three `--restore-tokens` prefixes (65,536 by default) offloaded durably into pools that hold
  one, then restored in turn into the pool (lookup + load, timed at the client, every object from disk), each
  round next to fio reading the segment bytes that prefix's offload wrote (O_DIRECT through libaio at the request
  size and queue depth of kvtier's loads, into huge-page buffers where it can have them: `bench/fio_limit.py`,
  the `fio` object says which memory), ABBA order, page cache dropped before each side. `MBps` and `fio_MBps`
  are each side's best round; `ratio_to_fio` is the median of the rounds' restore / fio ratios (`round_ratios`):
  each pair ran back to back, on the same shared disk. `round_MBps` lists each round's [restore, fio] MB/s, so a
  round where one side was slow shows which side. Without fio the restore has no limit: `fio.missing` says so.

Usage: python bench/daemon.py [--profile deepseek-v4-flash] [--lookup-tokens 16384] [--load-tokens 12288] [--rounds 3]
       [--restore-tokens 65536] [--only dsv4_restore]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fio_limit import HugeBuffers, described, fio_read, geometry, missing  # noqa: E402
from pagecache import drop_cache_tree  # noqa: E402
from slots import slot_targets  # noqa: E402

from kvtier.client import Client, OffloadReport  # noqa: E402
from kvtier.core.forms import GroupKind, Route  # noqa: E402
from kvtier.core.hashing import block_hashes  # noqa: E402
from kvtier.core.hugepages import read_host  # noqa: E402
from kvtier.core.parent import tied_env  # noqa: E402
from kvtier.core.profile import ModelProfile, load_profile  # noqa: E402
from kvtier.core.tier import LoadRequest, ObjectKey  # noqa: E402
from kvtier.gpu import CacheManager  # noqa: E402
from kvtier.refmodel.demo import settle_pages  # noqa: E402
from kvtier.store import DiskStore  # noqa: E402


def _caches(profile: ModelProfile, n_blocks: int, fill: int) -> dict[str, dict[int, torch.Tensor]]:
    """History objects for every block, state objects for the trailing window (one tensor per group, shared)."""
    h = profile.hash_block_tokens
    out = {}
    for g in profile.groups:
        obj = torch.full((g.object_bytes(h),), fill, dtype=torch.uint8)
        first = 0 if g.kind is GroupKind.HISTORY else max(0, n_blocks - g.blocks_needed(h))
        out[g.name] = {b: obj for b in range(first, n_blocks)}
    return out


def _check(rep: OffloadReport) -> None:
    if rep.refused or rep.skipped:
        raise SystemExit(f"offload incomplete ({rep}): the pools are too small for this benchmark's prefixes")


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n, dtype=np.int64)


def _start(tmp: Path, profile: str, pools: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path, socket.socket]:
    sock_path = tmp / "kvtier.sock"
    cfg = tmp / "kvtier.toml"
    pool_lines = "".join(f'{k} = "{v}"\n' for k, v in pools.items())
    cfg.write_text(
        f'device = "cpu"\nprofiles = ["{profile}"]\npersist_queue_depth = 100000\n'
        f'[server]\nsocket = "{sock_path}"\n[store]\nroot = "{tmp / "store"}"\nbudget_bytes = "8GiB"\nio_threads = 4\n'
        f'[pool.budget_bytes]\n{pool_lines}[verifier]\nmode = "off"\n[metrics]\naddress = ""\n'
        "[admission]\nmax_recovering = 1024\n"
    )
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = tmp / "notify.sock"
    notify_path.unlink(missing_ok=True)
    notify.bind(str(notify_path))
    notify.settimeout(120)
    # it drains and exits if this bench dies, killed by run_all's timeout or a user (`kvtier.core.parent`)
    env = tied_env(dict(os.environ, NOTIFY_SOCKET=str(notify_path), PYTHONPATH=str(ROOT)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(cfg)], env=env, stderr=subprocess.DEVNULL
    )
    while b"READY=1" not in notify.recv(4096):
        pass
    settle_pages(sock_path)  # its pools as they stay: moved onto huge pages where the host does that after start
    return proc, sock_path, notify


def _stop(proc: subprocess.Popen[bytes], notify: socket.socket) -> None:
    proc.send_signal(signal.SIGTERM)
    if proc.wait(120) != 0:
        raise SystemExit(f"daemon exited {proc.returncode}")
    notify.close()


def bench_lookup(profile: ModelProfile, sock: Path, tokens: int, n: int) -> dict:
    h = profile.hash_block_tokens
    blocks = tokens // h
    toks = _tokens(1, blocks * h)
    caches = _caches(profile, blocks, 7)
    with Client(sock) as c:
        c.attach(profile.name)
        _check(c.offload(toks, caches))
        hashes = c.hashes(toks)
        for _ in range(20):
            c.release(c.lookup(hashes=hashes))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.lookup(hashes=hashes)
            times.append(time.perf_counter() - t0)
            c.release(r)
        assert r.hit_tokens == blocks * h and not r.needs_load, "the lookup prefix must be resident"
    # the same lookup in process, on a manager holding the same blocks
    mgr = CacheManager(
        profile, budgets_bytes={"compressed": 256 << 20, "indexer": 64 << 20, "swa": 64 << 20, "tail": 64 << 20}
    )
    hs = block_hashes(profile.namespace, toks, h)
    for name, objs in caches.items():
        g = profile.group(name)
        for b, t in objs.items():
            mgr.write_block(ObjectKey(profile.namespace, hs[b], name, g.form), t, layout_digest=mgr.layout_digest(name))
    local = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        res = mgr.lookup(hs)
        mgr.grid(res)  # the daemon also resolves every REUSE slot for the reply
        dt = time.perf_counter() - t0
        mgr.release(res)
        if i >= 20:
            local.append(dt)
    assert res.check_vector.hit_blocks == blocks
    mgr.close()
    p50, p99 = np.percentile(times, [50, 99]) * 1e3
    local_p50 = float(np.percentile(local, 50) * 1e3)
    return {
        "tokens": blocks * h,
        "blocks": blocks,
        "n": n,
        "p50_ms": round(float(p50), 3),
        "p99_ms": round(float(p99), 3),
        "inproc_p50_ms": round(local_p50, 3),
        "ratio_p50": round(float(p50) / local_p50, 2),
    }


def bench_load(profile: ModelProfile, tmp: Path, sock: Path, tokens: int, rounds: int) -> dict:
    """Three prefixes offloaded durably, then loaded in turn through the daemon (after a warm-up round of each) and,
    in the same round, the same objects loaded by `DiskStore.load_into` in this process (a read-only store on the
    daemon's directory), ABBA order: each pair runs back to back on the same shared disk, so `ratio` is the
    median of the rounds' daemon / direct ratios (`round_ratios`)."""
    h = profile.hash_block_tokens
    blocks = tokens // h
    seeds = (10, 11, 12)  # three in turn: a prefix was evicted whole by the two loaded since (the pools hold one)
    prefixes = [_tokens(seed, blocks * h) for seed in seeds]
    digests = {g.name: profile.layout(g).digest for g in profile.groups}
    requests: list[list[LoadRequest]] = []  # per prefix: its objects into page-aligned tensors
    daemon_s: list[float] = []
    direct_s: list[float] = []
    sizes: list[int] = []
    objects = 0
    with Client(sock) as c:
        c.attach(profile.name)
        for seed, toks in zip(seeds, prefixes):
            _check(c.offload(toks, _caches(profile, blocks, seed), durable=True))
        for toks in prefixes:  # warm-up; the lookup says which objects a load of the prefix reads
            r = c.lookup(toks)
            recover = r.check_vector.routes != Route.RECOMPUTE  # servable: all of it is on disk (durable)
            c.load(r)
            c.release(r)
            hs = block_hashes(profile.namespace, toks, h)
            keys = [(profile.groups[gi], hs[b]) for gi, b in zip(*np.nonzero(recover))]
            outs = slot_targets([g.object_bytes(h) for g, _ in keys])
            requests.append(
                [
                    LoadRequest(ObjectKey(profile.namespace, hb, g.name, g.form), out, digests[g.name])
                    for (g, hb), out in zip(keys, outs)
                ]
            )
        with DiskStore(str(tmp / "store"), readonly=True) as store:
            backend = store.io_backend
            for reqs in requests:  # the direct side's warm-up
                store.load_into(reqs)
            for i in range(2 * rounds):
                toks, reqs = prefixes[i % 3], requests[i % 3]
                direct_first = i % 4 in (1, 2)  # ABBA
                if direct_first:
                    direct_s.append(_direct_load(store, reqs))
                r = c.lookup(toks)
                t0 = time.perf_counter()
                rep = c.load(r)
                daemon_s.append(time.perf_counter() - t0)
                c.release(r)
                if not direct_first:
                    direct_s.append(_direct_load(store, reqs))
                want = sum(q.out.numel() for q in reqs)
                if rep.loaded_bytes != want:
                    raise SystemExit(
                        f"load: the daemon read {rep.loaded_bytes} of the prefix's {want} bytes from disk (the pools"
                        " must hold one prefix, so that the two loaded since evicted it)"
                    )
                sizes.append(want)
                objects += rep.loaded_objects
    daemon_rate = np.array(sizes) / np.array(daemon_s)
    direct_rate = np.array(sizes) / np.array(direct_s)
    return {
        "objects": objects,
        "bytes": sum(sizes),
        "daemon_MBps": round(sum(sizes) / sum(daemon_s) / 1e6, 1),
        "direct_MBps": round(sum(sizes) / sum(direct_s) / 1e6, 1),
        "io_backend": backend,
        "ratio": round(float(np.median(daemon_rate / direct_rate)), 2),
        "round_ratios": [round(float(x), 2) for x in daemon_rate / direct_rate],
        "tokens": blocks * h,
    }


def _direct_load(store: DiskStore, reqs: list[LoadRequest]) -> float:
    t0 = time.perf_counter()
    answers = store.load_into(reqs)
    dt = time.perf_counter() - t0
    if any(a != 0 for a in answers):
        raise SystemExit("load: direct loads failed")
    return dt


def bench_dsv4_restore(profile: ModelProfile, tokens: int, rounds: int) -> dict:
    """Three `tokens` prefixes offloaded durably into one daemon whose history pools hold one prefix and a few
    blocks (state pools: two checkpoints), restored in turn, so every restore finds its prefix wholly evicted and
    reads all of its objects from disk. Each round restores one prefix (lookup + load, timed at the client; page
    cache dropped first, the store reads with O_DIRECT) and reads the bytes that prefix's offload wrote to the
    segment files with fio at kvtier's request size and depth (page cache dropped first), in ABBA order.
    The pool's memory is warm (the offloads wrote it), as in a daemon that has been serving: a restore into a
    daemon just started also pays the first touch of every pool page, reported apart as `fresh_daemon_MBps`."""
    h = profile.hash_block_tokens
    blocks = tokens // h
    per_block = profile.bytes_per_hash_block()
    pools = {f: str(per_block[f] * (blocks + 8 if f in ("compressed", "indexer") else 2)) for f in per_block}
    prefixes = [_tokens(20 + k, blocks * h) for k in range(3)]
    want = sum(g.object_bytes(h) * (blocks if g.kind is GroupKind.HISTORY else 1) for g in profile.groups)
    restore_mbps: list[float] = []  # per round, in order
    fio_mbps: list[float] = []
    no_fio = missing()
    geo = geometry()
    # the daemon's pools start while fio's pages and theirs are reserved: both sides read into the same memory
    buffers = HugeBuffers(geo, kvtier_pools=[int(v) for v in pools.values()])
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=os.environ.get("KVTIER_BENCH_DIR", "/var/tmp")) as d,
        buffers,
    ):
        tmp = Path(d)
        store, segments = tmp / "store", tmp / "store" / "segments"
        spans: list[list[tuple[Path, int, int]]] = []  # per prefix: (segment file, offset, bytes) its offload wrote
        free = read_host().hugetlb_free
        proc, sock, notify = _start(tmp, profile.name, pools)
        pool_pages = free - read_host().hugetlb_free  # the hugetlb pages the daemon's pools took
        try:
            with Client(sock) as c:
                c.attach(profile.name)
                before: dict[Path, int] = {}
                for seed, toks in enumerate(prefixes):
                    _check(c.offload(toks, _caches(profile, blocks, 20 + seed), durable=True))
                    after = {f: f.stat().st_size for f in segments.glob("*.seg")}
                    spans.append([(f, before.get(f, 0), n - before.get(f, 0)) for f, n in sorted(after.items())])
                    before = after
                for i in range(2 * rounds):
                    toks, span = prefixes[i % 3], spans[i % 3]
                    fio_first = i % 4 in (1, 2)  # ABBA: restore, fio | fio, restore | fio, restore | restore, fio
                    if fio_first and not no_fio:
                        fio_mbps.append(_fio(store, span, buffers))
                    restore_mbps.append(want / _restore(c, store, toks, want) / 1e6)
                    if not fio_first and not no_fio:
                        fio_mbps.append(_fio(store, span, buffers))
        finally:
            _stop(proc, notify)
        proc, sock, notify = _start(tmp, profile.name, pools)
        try:
            with Client(sock) as c:
                c.attach(profile.name)
                fresh_s = _restore(c, store, prefixes[0], want)
        finally:
            _stop(proc, notify)
    out = {
        "tokens": blocks * h,
        "bytes": want,
        "MBps": round(max(restore_mbps), 1),
        "fresh_daemon_MBps": round(want / fresh_s / 1e6, 1),
        "pool_hugetlb_pages": pool_pages,  # 0: the daemon's pools are on small pages (or THP), not reserved ones
    }
    if no_fio:
        return {**out, "fio": {"missing": no_fio}, "round_MBps": [round(r) for r in restore_mbps]}
    return {
        **out,
        "fio": described(
            geo,
            buffers.memory,
            "fio --rw=read over the segment bytes each prefix's offload wrote, cold (O_DIRECT), ABBA",
            bytes=sum(n for _, _, n in spans[0]),
        ),
        "fio_MBps": round(max(fio_mbps), 1),
        "ratio_to_fio": round(float(np.median(np.array(restore_mbps) / np.array(fio_mbps))), 2),
        "round_ratios": [round(r / t, 2) for r, t in zip(restore_mbps, fio_mbps)],
        "round_MBps": [[round(r), round(t)] for r, t in zip(restore_mbps, fio_mbps)],
    }


def _restore(c: Client, store: Path, toks: np.ndarray, want: int) -> float:
    """Seconds to look a prefix up and load it into the pool, page cache of the store dropped first; every byte
    of the prefix must come from disk."""
    drop_cache_tree(store)
    t0 = time.perf_counter()
    r = c.lookup(toks)
    rep = c.load(r)
    dt = time.perf_counter() - t0
    c.release(r)
    if rep.loaded_bytes != want or r.hit_tokens != len(toks):
        raise SystemExit(
            f"dsv4_restore: hit {r.hit_tokens} of {len(toks)} tokens, loaded {rep.loaded_bytes} of {want} bytes "
            "from disk (the pools must hold one prefix and evict least recently used first)"
        )
    return dt


def _fio(store: Path, span: list[tuple[Path, int, int]], buffers: HugeBuffers) -> float:
    """MB/s of fio reading each (file, offset, bytes) of `span` at kvtier's geometry, page cache dropped first."""
    drop_cache_tree(store)
    return fio_read(span, geometry(), buffers).MBps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="deepseek-v4-flash")
    ap.add_argument("--lookup-tokens", type=int, default=16384)
    ap.add_argument("--load-tokens", type=int, default=12288)
    ap.add_argument("--lookups", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--restore-tokens", type=int, default=65536, help="dsv4_restore's prefix (0: skip it).")
    ap.add_argument("--only", choices=("dsv4_restore",), help="Run only this part (the others print null).")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    if args.only == "dsv4_restore":
        restore = bench_dsv4_restore(profile, args.restore_tokens, args.rounds)
        print(json.dumps({"profile": args.profile, "lookup": None, "load": None, "dsv4_restore": restore}))
        return
    h = profile.hash_block_tokens
    per_block = profile.bytes_per_hash_block()
    load_blocks = args.load_tokens // h
    # pools hold one load prefix and a few blocks (history, or the lookup prefix if larger) and two checkpoints of
    # state: of three prefixes loaded in turn, each finds itself evicted by the two before
    pools = {
        "compressed": per_block["compressed"] * (load_blocks + 8),
        "indexer": per_block["indexer"] * (load_blocks + 8),
        "swa": per_block["swa"] * 2,
        "tail": per_block["tail"] * 2,
    }
    pools["compressed"] = max(pools["compressed"], per_block["compressed"] * (args.lookup_tokens // h + 8))
    pools["indexer"] = max(pools["indexer"], per_block["indexer"] * (args.lookup_tokens // h + 8))
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=os.environ.get("KVTIER_BENCH_DIR", "/var/tmp")) as d:
        tmp = Path(d)
        proc, sock, notify = _start(tmp, args.profile, {k: str(v) for k, v in pools.items()})
        try:
            lookup = bench_lookup(profile, sock, args.lookup_tokens, args.lookups)
            load = bench_load(profile, tmp, sock, args.load_tokens, args.rounds)
        finally:
            _stop(proc, notify)
    restore = bench_dsv4_restore(profile, args.restore_tokens, args.rounds) if args.restore_tokens else None
    print(
        json.dumps(
            {
                "profile": args.profile,
                "lookup": lookup,
                "load": load,
                "dsv4_restore": restore,
            }
        )
    )


if __name__ == "__main__":
    main()
