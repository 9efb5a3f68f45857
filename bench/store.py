"""Disk store throughput next to the disk's own limit on the same filesystem, in one run; prints one JSON object.

Sequential write (store_many, group commit: one fdatasync + one LMDB commit per batch, checksums on) of >= 1 GiB
in fixed-size records, against `dd oflag=direct conv=fsync` of the same size with the same block size. Cold
sequential read (load_into batches into page-aligned targets in the memory the daemon's pool slots are,
`bench/slots.py`; O_DIRECT, or page cache dropped with posix_fadvise(DONTNEED) on the buffered backend) of the
records written, against fio reading the store's own segment files with O_DIRECT through libaio at the request
size and queue depth kvtier's loads use, into huge-page buffers where it can have them (`bench/fio_limit.py`; the
`fio` object says which memory). In each round the cold read and fio go in ABBA order; rounds are `--repeat`
(the disk is shared) and each side's best is reported with fio's own MB/s beside it. `read_ratio_to_fio` is the
median of the rounds' read / fio ratios (`round_ratios`): each round pairs the two sides as they ran next to each
other, so a moment in which the shared disk was slow weighs on both (as the DSV4 restore's ratio in bench/daemon.py);
`read_ratio_best_over_best` is the one best over the other, which pairs figures from different moments. Without fio
the read has no limit: `fio.missing` says so.

`small_load_objects_per_s`: 1,024 random 1 KB records out of `--small-records`, loaded cold in one load_into
(`small_seq_load_objects_per_s`: 1,024 consecutive ones, as a prefix restore reads them). Its limit,
`small_load_fio_iops`: fio's random 4 KiB O_DIRECT reads per second in the same segment files at the AIO depth, after
kvtier's loads in each round (`small_load_ratio_to_fio`: the best of each side, the one over the other).
`read_cpu_ms_per_object` and `small_load_cpu_us_per_object`: the CPU time of this process (all its threads) per object
of the cold read and of the random small load, the least of the rounds. `small_call_cpu_us`: the loading thread's CPU
per load_into call of 1 and of 32 random small records (a call's own cost: a daemon's small loads pay it each).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import NamedTuple

import torch
import xxhash
from fio_limit import Geometry, HugeBuffers, described, fio_random_iops, fio_read, geometry, missing
from pagecache import drop_cache_tree
from slots import slot_pool

from kvtier.core import CacheForm, VersionKey
from kvtier.core.layout import slot_stride
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import SEGMENTS_DIR, DiskStore, StoreConfig

MB = 1e6
# fio's random reads for the small loads' limit: 8 times a load's, so that its runtime, which fio gives in whole
# milliseconds, is long enough to count
SMALL_FIO_IOS = 8192
SMALL_LOAD = 1024  # small records per load, random and sequential
# Loads of a few small records, timed per call: batch sizes, calls timed and calls before them
CALL_BATCHES = (1, 32)
CALL_LOADS = 50
CALL_WARMUP = 5


class Limit(NamedTuple):
    """fio's part of a run: kvtier's read geometry and the buffers fio reads into."""

    geo: Geometry
    buffers: HugeBuffers


def dd_seconds(args: list[str]) -> float:
    res = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.]+) s", res.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {res.stderr!r}")
    return float(m.group(1))


def raw_write(work: str, record_mib: int, count: int) -> float:
    """dd O_DIRECT write (fsync at the end) of the same bytes, with the store's record size as block size."""
    raw = os.path.join(work, "dd.bin")
    write_s = dd_seconds(
        ["if=/dev/zero", f"of={raw}", f"bs={record_mib}M", f"count={count}", "oflag=direct", "conv=fsync"]
    )
    os.unlink(raw)
    return write_s


def segment_spans(root: str) -> list[tuple[str, int, int]]:
    """(file, 0, bytes) of every segment file of the store at `root`, cut to whole 4096-byte blocks (O_DIRECT)."""
    seg_dir = os.path.join(root, SEGMENTS_DIR)
    paths = sorted(os.path.join(seg_dir, n) for n in os.listdir(seg_dir))
    return [(p, 0, os.path.getsize(p) // 4096 * 4096) for p in paths]


def store_pass(
    work: str, record: int, count: int, args: argparse.Namespace, limit: Limit | None, fio_first: bool
) -> tuple[float, float, float, str, float | None, str]:
    """Write `count` records with store_many, reopen, read them all back cold with load_into and verify the bytes;
    fio reads the store's segment files before or after (`fio_first`). Returns write and read seconds, the CPU
    seconds of the read (this process, every thread), the backend, fio's MB/s (None without fio), and how the load
    targets' pool got its pages."""
    root = os.path.join(work, "store")
    vk = VersionKey("bench", "w", "abi", "c", "i", "fp8")
    payloads = [torch.randint(0, 256, (record,), dtype=torch.uint8) for _ in range(4)]
    digest = b"B" * 16
    keys = [
        ObjectKey(vk.namespace, xxhash.xxh3_128_digest(b"%d" % i), "c4", CacheForm.COMPRESSED) for i in range(count)
    ]
    cfg = StoreConfig(io_threads=args.io_threads, io_backend=args.io_backend, segment_bytes=1 << 30)
    batches = [range(start, min(count, start + args.batch)) for start in range(0, count, args.batch)]
    with DiskStore(root, cfg, writer=True) as store:
        store.register_namespace(vk)
        backend = store.io_backend
        t0 = time.perf_counter()
        for idx in batches:
            store.store_many([(keys[i], payloads[i % len(payloads)], digest) for i in idx])
        write_s = time.perf_counter() - t0
    fio_mbps = None
    if limit is not None and fio_first:
        fio_mbps = fio_read(segment_spans(root), limit.geo, limit.buffers).MBps
    if backend == "buffered":
        drop_cache_tree(os.path.join(root, SEGMENTS_DIR))
    with DiskStore(root, cfg) as store:
        outs, pages = slot_pool([record] * args.batch)
        bad = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for idx in batches:
            reasons = store.load_into([LoadRequest(keys[i], outs[j], digest) for j, i in enumerate(idx)])
            bad += sum(r.name != "OK" for r in reasons)
        read_s, read_cpu = time.perf_counter() - t0, time.process_time() - c0
        last = batches[-1]
        if bad or not all(torch.equal(outs[j], payloads[i % len(payloads)]) for j, i in enumerate(last)):
            raise SystemExit(f"{bad} of {count} records did not read back correctly")
    if limit is not None and not fio_first:
        fio_mbps = fio_read(segment_spans(root), limit.geo, limit.buffers).MBps
    shutil.rmtree(root)
    return write_s, read_s, read_cpu, backend, fio_mbps, pages


def small_pass(
    work: str, args: argparse.Namespace, fio: bool
) -> tuple[float, float, float, float | None, dict[int, float]]:
    """1 KB records written in batches of 256; then 1,024 random ones loaded cold (O_DIRECT or page cache
    dropped), in one load_into; and a sequential 1,024 (a prefix's blocks). Returns objects/s of each, the
    random load's CPU seconds (this process, every thread), with `fio` fio's random 4 KiB reads per second
    over the same segment files (SMALL_FIO_IOS of them at the AIO depth), and per batch size of CALL_BATCHES the
    median CPU seconds of the loading thread per load_into call of that many random records."""
    root = os.path.join(work, "small")
    vk = VersionKey("bench-small", "w", "abi", "c", "i", "fp8")
    digest = b"S" * 16
    n, size, want = args.small_records, 1024, SMALL_LOAD
    keys = [ObjectKey(vk.namespace, xxhash.xxh3_128_digest(b"s%d" % i), "c4", CacheForm.COMPRESSED) for i in range(n)]
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
    cfg = StoreConfig(io_backend=args.io_backend)
    with DiskStore(root, cfg, writer=True) as store:
        store.register_namespace(vk)
        for start in range(0, n, 256):
            store.store_many([(k, payload, digest) for k in keys[start : start + 256]])
    rates, cpu = [], []
    for pick in (random.Random(1).sample(range(n), want), list(range(n // 2, n // 2 + want))):
        if os.path.exists(os.path.join(root, SEGMENTS_DIR)):
            drop_cache_tree(os.path.join(root, SEGMENTS_DIR))
        with DiskStore(root, cfg) as store:
            outs = [torch.empty(size, dtype=torch.uint8) for _ in pick]
            requests = [LoadRequest(keys[i], o, digest) for i, o in zip(pick, outs)]  # the caller's part
            store.has(keys[:1], [digest])  # open the index outside the timing
            gc.collect()  # a full pass owed by what this process allocated before would land inside the timing
            t0, c0 = time.perf_counter(), time.process_time()
            reasons = store.load_into(requests)
            rates.append(want / (time.perf_counter() - t0))
            cpu.append(time.process_time() - c0)
            if any(r.name != "OK" for r in reasons) or not torch.equal(outs[-1], payload):
                raise SystemExit("small records did not read back correctly")
    call_cpu = call_cpu_s(root, cfg, keys, digest, size)
    iops = min(fio_random_iops(p, n, SMALL_FIO_IOS) for p, _, n in segment_spans(root)) if fio else None
    shutil.rmtree(root)
    return rates[0], rates[1], cpu[0], iops, call_cpu


def call_cpu_s(root: str, cfg: StoreConfig, keys: list[ObjectKey], digest: bytes, size: int) -> dict[int, float]:
    """Per batch size of CALL_BATCHES, the median CPU seconds of the loading thread per load_into call of that many
    random records (CALL_LOADS calls each, after CALL_WARMUP): what a call costs beside its records (the lookups,
    planning, submission and checks a small load through the daemon pays)."""
    rng = random.Random(7)
    out: dict[int, float] = {}
    with DiskStore(root, cfg) as store:
        for batch in CALL_BATCHES:
            costs = []
            for i in range(CALL_WARMUP + CALL_LOADS):
                requests = [
                    LoadRequest(keys[k], torch.empty(size, dtype=torch.uint8), digest)
                    for k in rng.sample(range(len(keys)), batch)
                ]
                c0 = time.thread_time()
                reasons = store.load_into(requests)
                if i >= CALL_WARMUP:
                    costs.append(time.thread_time() - c0)
                if any(r.name != "OK" for r in reasons):
                    raise SystemExit("small records did not read back correctly")
            out[batch] = statistics.median(costs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="Directory on the filesystem to measure.")
    ap.add_argument("--gib", type=float, default=1.0, help="Bytes to write and read, in GiB (>= 1 for the target).")
    ap.add_argument("--record-mib", type=int, default=4, help="Record size in MiB (1-8).")
    ap.add_argument("--batch", type=int, default=32, help="Records per store_many / load_into call.")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--io-backend", default="auto")
    ap.add_argument("--repeat", type=int, default=2, help="Rounds of store and fio reads (ABBA); each one's best.")
    ap.add_argument("--small-records", type=int, default=20_000, help="1 KB records in the small-object store.")
    args = ap.parse_args()
    if args.small_records < 2 * SMALL_LOAD:  # the sequential load reads SMALL_LOAD records from the middle
        ap.error(f"--small-records must be at least {2 * SMALL_LOAD}, got {args.small_records}")

    record = args.record_mib << 20
    count = int(args.gib * (1 << 30)) // record
    total = count * record
    work = tempfile.mkdtemp(prefix="kvtier-bench-store-", dir=args.dir)
    raw_w, st_w, st_r, fio_r, small_rand, small_seq, small_fio = [], [], [], [], [], [], []
    read_cpu, small_cpu = [], []
    calls: dict[int, list[float]] = {b: [] for b in CALL_BATCHES}
    no_fio = missing()
    geo = geometry()
    # the load targets' pages are reserved beside fio's: both sides read into the same kind of memory
    buffers = HugeBuffers(geo, kvtier_pools=[args.batch * slot_stride(record)])
    try:
        with buffers:
            limit = None if no_fio else Limit(geo, buffers)
            for r in range(args.repeat):
                rand, seq, rand_cpu, iops, call_cpu = small_pass(work, args, fio=limit is not None)
                for b, c in call_cpu.items():
                    calls[b].append(c)
                if iops is not None:
                    small_fio.append(iops)
                small_rand.append(rand)
                small_cpu.append(rand_cpu)
                small_seq.append(seq)
                raw_w.append(raw_write(work, args.record_mib, count))
                fio_first = r % 4 in (1, 2)
                w, rd, rd_cpu, backend, fio_mbps, pages = store_pass(work, record, count, args, limit, fio_first)
                st_w.append(w)
                st_r.append(rd)
                read_cpu.append(rd_cpu)
                if fio_mbps is not None:
                    fio_r.append(fio_mbps)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    read_mbps = [total / s / MB for s in st_r]
    fio: dict = (
        {"missing": no_fio}
        if no_fio
        else described(
            geo,
            buffers.memory,
            "fio --rw=read over the store's segment files, cold (O_DIRECT), ABBA with the store's read",
        )
    )
    out = {
        "write_MBps": round(total / min(st_w) / MB, 1),
        "read_MBps": round(max(read_mbps), 1),
        "raw_write_MBps": round(total / min(raw_w) / MB, 1),
        "write_ratio": round(min(raw_w) / min(st_w), 3),
        "fio": fio,
        **(
            {}
            if no_fio
            else {
                "fio_read_MBps": round(max(fio_r), 1),
                "read_ratio_to_fio": round(statistics.median(k / f for k, f in zip(read_mbps, fio_r)), 3),
                "read_ratio_best_over_best": round(max(read_mbps) / max(fio_r), 3),
                "round_ratios": [round(k / f, 2) for k, f in zip(read_mbps, fio_r)],
                # the small loads' disk limit: fio's random 4 KiB reads per second at the AIO depth
                "small_load_fio_iops": round(max(small_fio)),
                "small_load_ratio_to_fio": round(max(small_rand) / max(small_fio), 3),
            }
        ),
        "small_load_objects_per_s": round(max(small_rand)),
        "small_seq_load_objects_per_s": round(max(small_seq)),
        # CPU of this process (every thread) per object: the cold read's per record, the random small load's per
        # object; each the least of the rounds
        "read_cpu_ms_per_object": round(min(read_cpu) / count * 1e3, 3),
        "small_load_cpu_us_per_object": round(min(small_cpu) / SMALL_LOAD * 1e6, 1),
        # CPU of the loading thread per load_into call of a few random small records (median of a round, least of
        # the rounds), by batch size
        "small_call_cpu_us": {str(b): round(min(c) * 1e6) for b, c in calls.items()},
        "record_MiB": args.record_mib,
        "backend": backend,
        "targets_pages": pages,
        "bytes": total,
        "batch": args.batch,
        "io_threads": args.io_threads,
        "repeat": args.repeat,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
