"""What the memory a restore reads into costs, by kind of page, in one run; prints one JSON object.

Why: kvtier's cpu pools are shared memory (a memfd), which the kernel gives transparent huge pages only under
`transparent_hugepage/shmem_enabled` = advise / within_size / always; most distributions ship `never`. A read
with O_DIRECT into scattered 4 KiB pages is cut into requests of at most `max_segments` pages, so this measures
what `never` costs and what each way around it buys (kvtier.core.hugepages).

`targets`: a deepseek-v4-flash prefix's history objects (`--tokens`), stored once, read back cold with
`DiskStore.load_into` (page cache dropped, O_DIRECT) in batches of `--batch-mib`, into each kind of memory, the
kinds rotated round by round so none always goes first on the shared disk:

- `shmem`: a memfd as the pools make it (MADV_HUGEPAGE, pages taken at once) under the host's own setting;
- `shmem_thp`: the same memfd made while `shmem_enabled` = advise (root; the setting is put back as soon as the
  pages are taken, before any read);
- `collapse`: a `shmem` memfd moved onto transparent huge pages after its pages are taken (MADV_COLLAPSE, 2 MiB at a
  time), as the daemon moves its pools where shmem_enabled grants none (`kvtier.gpu.page_move`);
- `hugetlb`: a `MFD_HUGETLB` memfd (root: `vm.nr_hugepages` raised to cover it for the allocation, put back
  after; the pages in use stay until the memfd goes);
- `bounce`: each batch read into private anonymous memory with MADV_HUGEPAGE (huge pages under `enabled` =
  madvise, the usual default), then copied into a `shmem` memfd: the copy is inside the timing;
- `anon_thp`: the bounce's reads alone, no copy (what the bounce pays before its copy).

Each kind reports its best and median MB/s, the huge-page bytes its memory really got (`huge_bytes`), and the
block device's read requests over its passes (`/sys/block/<dev>/stat`: requests completed and sectors, so
`kib_per_request`; other processes' reads on the same disk count too, so compare kinds within one run).
`vs_shmem` is each kind's median over `shmem`'s median, measured in the same rounds.

`benches` (`--benches`, root): `bench/daemon.py --only dsv4_restore` and `bench/store.py`'s cold read, each run
whole (unmodified) under three host modes: `never`, `advise`, and `hugetlb` (`never` with `--hugetlb-pages`
reserved, which the pools take), the order rotated round by round, with the device's request counts around
each run; the settings are put back after each.

Usage: python bench/thp.py [--tokens 65536] [--rounds 4] [--batch-mib 32] [--benches] [--bench-rounds 3]
       [--hugetlb-pages 400]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from pagecache import drop_cache_tree  # noqa: E402

from kvtier.core import hugepages  # noqa: E402
from kvtier.core.forms import GroupKind  # noqa: E402
from kvtier.core.hashing import block_hashes  # noqa: E402
from kvtier.core.layout import slot_stride  # noqa: E402
from kvtier.core.profile import load_profile  # noqa: E402
from kvtier.core.tier import LoadRequest, ObjectKey  # noqa: E402
from kvtier.core.versions import VersionKey  # noqa: E402
from kvtier.gpu import PageMove  # noqa: E402
from kvtier.store import DiskStore, StoreConfig  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
MFD_HUGETLB = 0x0004


# ---- the host ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def flipped(path: Path, value: str) -> Iterator[bool]:
    """`path` set to `value` inside the block and put back after, whatever happens; False where it cannot be set."""
    text = path.read_text()
    old = text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()
    try:
        path.write_text(value)
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        path.write_text(old)


def block_device(where: Path) -> Path | None:
    """/sys/block/<dev> of the disk under `where` (the whole disk for a partition), None where it has none."""
    st = os.stat(where)
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not node.exists():
        return None
    real = node.resolve()
    return real.parent if (real / "partition").exists() else real


def read_counts(dev: Path | None) -> tuple[int, int]:
    """(read requests completed, sectors read) of the device."""
    if dev is None:
        return 0, 0
    fields = (dev / "stat").read_text().split()
    return int(fields[0]), int(fields[2])


# ---- the memory kinds --------------------------------------------------------------------------------------------


class Memory:
    """A page-aligned uint8 tensor over a mapping this object keeps alive."""

    def __init__(self, nbytes: int, *, hugetlb: bool = False, shared: bool = True, move: bool = False) -> None:
        size = -(-nbytes // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
        self.map: mmap.mmap | ctypes.Array[ctypes.c_char]
        if shared:
            self.fd = os.memfd_create("kvtier-thp-bench", os.MFD_CLOEXEC | (MFD_HUGETLB if hugetlb else 0))
            os.ftruncate(self.fd, size)
            self.map = hugepages.map_shared(self.fd, size)  # 2 MiB aligned, as the pools are
        else:
            self.fd = -1
            self.map = mmap.mmap(-1, size + hugepages.HUGE_PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self.map, dtype=torch.uint8)
        skip = 0 if shared else (-whole.data_ptr()) % hugepages.HUGE_PAGE  # 2 MiB aligned, so every PMD can be huge
        self.tensor = whole[skip : skip + size]
        self.size = size
        del whole
        if not hugetlb:
            hugepages.advise_huge(self.tensor.data_ptr(), size)
        if not hugepages.populate(self.tensor.data_ptr(), size):
            self.tensor.fill_(0)
        if move:  # as the daemon moves its pools after start, here before any read
            PageMove(self.tensor.data_ptr(), size, self.tensor).run()

    def close(self) -> None:
        """Let the mapping go (unmapped once the last view of it is gone) and close the memfd."""
        del self.tensor, self.map
        if self.fd >= 0:
            os.close(self.fd)

    def huge(self) -> int:
        return hugepages.huge_bytes([(self.tensor.data_ptr(), self.tensor.numel())])

    def views(self, sizes: list[int]) -> list[torch.Tensor]:
        out, at = [], 0
        for n in sizes:
            out.append(self.tensor[at : at + n])
            at += slot_stride(n)
        return out


def make_kinds(total: int, batch_bytes: int) -> tuple[dict[str, Memory], dict[str, str]]:
    """Every kind this host and user can make; and why each missing one is missing."""
    kinds, missing = {"shmem": Memory(total)}, {}
    if hugepages.setting("shmem_enabled") == "absent":
        missing["shmem_thp"] = "no transparent huge pages in this kernel"
    else:
        try:
            with flipped(THP / "shmem_enabled", "advise") as ok:
                if ok:
                    kinds["shmem_thp"] = Memory(total)
                else:
                    missing["shmem_thp"] = "cannot write shmem_enabled (not root)"
        except OSError as exc:
            missing["shmem_thp"] = str(exc)
    pages = -(-total // hugepages.HUGE_PAGE)
    try:
        before = int(NR_HUGEPAGES.read_text())
        try:
            NR_HUGEPAGES.write_text(str(_meminfo("HugePages_Total") + pages))  # above the pages in use now
            kinds["hugetlb"] = Memory(total, hugetlb=True)
        finally:
            NR_HUGEPAGES.write_text(str(before))  # pages in use stay (surplus) until the memfd is closed
    except OSError as exc:
        missing["hugetlb"] = f"cannot reserve {pages} huge pages: {exc.strerror or exc}"
    if hugepages.collapse_works():
        kinds["collapse"] = Memory(total, move=True)
    else:
        missing["collapse"] = "MADV_COLLAPSE moves no shared memory here (Linux 6.1+, shmem_enabled not deny)"
    kinds["anon_thp"] = Memory(batch_bytes, shared=False)
    return kinds, missing


# ---- the reads ---------------------------------------------------------------------------------------------------


def write_prefix(root: Path, tokens: int) -> tuple[list[LoadRequest], list[int]]:
    """A deepseek-v4-flash prefix's history objects, stored durably; (the requests, without targets; their sizes)."""
    profile = load_profile("deepseek-v4-flash")
    h = profile.hash_block_tokens
    vk = VersionKey("thp-bench", "w", "abi", "c", "i", "fp8")
    digest = b"T" * 16
    hashes = block_hashes(vk.namespace, list(range(tokens)), h)
    groups = [g for g in profile.groups if g.kind is GroupKind.HISTORY]
    keys, sizes = [], []
    with DiskStore(root, StoreConfig(segment_bytes=1 << 30), writer=True) as store:
        store.register_namespace(vk)
        for bh in hashes:
            items = []
            for g in groups:
                n = g.object_bytes(h)
                key = ObjectKey(vk.namespace, bh, g.name, g.form)
                items.append((key, torch.full((n,), len(keys) % 251, dtype=torch.uint8), digest))
                keys.append(key)
                sizes.append(n)
            store.store_many(items)
    return [LoadRequest(k, torch.empty(0, dtype=torch.uint8), digest) for k in keys], sizes


def batches(sizes: list[int], batch_bytes: int) -> list[range]:
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        if acc and acc + slot_stride(n) > batch_bytes:
            out.append(range(start, i))
            start, acc = i, 0
        acc += slot_stride(n)
    out.append(range(start, len(sizes)))
    return out


def read_pass(
    store: DiskStore,
    reqs: list[LoadRequest],
    sizes: list[int],
    cuts: list[range],
    target: Memory,
    bounce: Memory | None,
) -> float:
    """Seconds to read every object into `target` (through `bounce` batch by batch, when given)."""
    dest = target.views(sizes)
    t0 = time.perf_counter()
    for cut in cuts:
        outs = [dest[i] for i in cut] if bounce is None else bounce.views([sizes[i] for i in cut])
        reasons = store.load_into([LoadRequest(reqs[i].key, o, reqs[i].layout_digest) for i, o in zip(cut, outs)])
        if any(r.name != "OK" for r in reasons):
            raise SystemExit(f"thp: {sum(r.name != 'OK' for r in reasons)} objects did not read back")
        if bounce is not None:
            for i, o in zip(cut, outs):  # memmove: what a reader in C would do; torch's copy_ is slower here
                ctypes.memmove(dest[i].data_ptr(), o.data_ptr(), sizes[i])
    dt = time.perf_counter() - t0
    last = len(sizes) - 1
    if int(dest[last][0]) != last % 251 or int(dest[last][-1]) != last % 251:
        raise SystemExit("thp: the last object read back wrong")
    return dt


def bench_targets(work: Path, tokens: int, rounds: int, batch_mib: int) -> dict:
    root = work / "store"
    reqs, sizes = write_prefix(root, tokens)
    total = sum(slot_stride(n) for n in sizes)
    batch_bytes = batch_mib << 20
    cuts = batches(sizes, batch_bytes)
    kinds, missing = make_kinds(total, batch_bytes)
    plans: dict[str, Callable[[DiskStore], float]] = {}
    for name in ("shmem", "shmem_thp", "collapse", "hugetlb"):
        if name in kinds:
            plans[name] = lambda s, m=kinds[name]: read_pass(s, reqs, sizes, cuts, m, None)
    plans["bounce"] = lambda s: read_pass(s, reqs, sizes, cuts, kinds["shmem"], kinds["anon_thp"])
    plans["anon_thp"] = lambda s: _anon(s, reqs, sizes, cuts, kinds["anon_thp"])
    dev = block_device(work)
    seconds: dict[str, list[float]] = {k: [] for k in plans}
    counts: dict[str, list[int]] = {k: [0, 0] for k in plans}
    names = list(plans)
    with DiskStore(root, StoreConfig(segment_bytes=1 << 30)) as store:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                drop_cache_tree(root)
                before = read_counts(dev)
                seconds[name].append(plans[name](store))
                after = read_counts(dev)
                counts[name][0] += after[0] - before[0]
                counts[name][1] += after[1] - before[1]
    huge = {name: kinds["shmem" if name == "bounce" else name].huge() for name in plans}
    for mem in kinds.values():  # hugetlb pages in use are surplus now: give them back before the next part
        mem.close()
    plans.clear()
    gc.collect()
    nbytes = sum(sizes)
    base = statistics.median(seconds["shmem"])
    out: dict[str, object] = {
        "tokens": tokens,
        "bytes": nbytes,
        "batch_mib": batch_mib,
        "device": dev.name if dev else None,
        "kinds": {},
        "missing": missing,
    }
    for name in names:
        mem = kinds["shmem" if name == "bounce" else name]
        reqs_n, sectors = counts[name]
        out["kinds"][name] = {  # type: ignore[index]
            "MBps_best": round(nbytes / min(seconds[name]) / 1e6, 1),
            "MBps_median": round(nbytes / statistics.median(seconds[name]) / 1e6, 1),
            "vs_shmem": round(base / statistics.median(seconds[name]), 2),
            "huge_bytes": huge[name],
            "memory_bytes": mem.size,
            "read_requests": reqs_n,
            "kib_per_request": round(sectors * 512 / 1024 / reqs_n, 1) if reqs_n else None,
            "round_MBps": [round(nbytes / s / 1e6) for s in seconds[name]],
        }
    return out


def _anon(store: DiskStore, reqs: list[LoadRequest], sizes: list[int], cuts: list[range], mem: Memory) -> float:
    """The bounce's reads alone: every batch into the same private huge-page memory, no copy."""
    t0 = time.perf_counter()
    for cut in cuts:
        outs = mem.views([sizes[i] for i in cut])
        store.load_into([LoadRequest(reqs[i].key, o, reqs[i].layout_digest) for i, o in zip(cut, outs)])
    return time.perf_counter() - t0


# ---- the project's own benches under both settings ---------------------------------------------------------------


@contextlib.contextmanager
def host_mode(mode: str, pages: int) -> Iterator[bool]:
    """The host as `mode` says inside the block, put back after: `never` / `advise` set shmem_enabled; `hugetlb` is
    `never` with `pages` more hugetlb pages reserved (vm.nr_hugepages), which the pools then take."""
    with flipped(THP / "shmem_enabled", "advise" if mode == "advise" else "never") as ok:
        if not ok or mode != "hugetlb":
            yield ok
            return
        before = NR_HUGEPAGES.read_text().strip()
        try:
            NR_HUGEPAGES.write_text(str(_meminfo("HugePages_Total") + pages))
            yield True
        finally:
            NR_HUGEPAGES.write_text(before)


def _meminfo(field: str) -> int:
    lines = Path("/proc/meminfo").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith(field))


def bench_both(work: Path, rounds: int, pages: int) -> dict:
    """bench/daemon.py's dsv4_restore and bench/store.py's cold read, whole runs under each host mode (`never`,
    `advise`, `hugetlb`), the order rotated round by round; the device's request counts around each."""
    dev = block_device(work)
    env = {**os.environ, "KVTIER_BENCH_DIR": str(work)}
    cmds = {
        "dsv4_restore": [sys.executable, str(ROOT / "bench/daemon.py"), "--only", "dsv4_restore", "--rounds", "2"],
        "store": [
            sys.executable,
            str(ROOT / "bench/store.py"),
            "--dir",
            str(work),
            "--repeat",
            "1",
            "--small-records",
            "2048",
        ],
    }
    modes = ["never", "advise", "hugetlb"]
    runs: list[dict] = []
    for r in range(rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:
            for name, cmd in cmds.items():
                with host_mode(mode, pages) as ok:
                    if not ok:
                        return {"skipped": "cannot write shmem_enabled (not root)"}
                    before = read_counts(dev)
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                    after = read_counts(dev)
                if proc.returncode != 0:
                    raise SystemExit(f"thp: {name} failed: {proc.stderr[-2000:]}")
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                reqs_n, sectors = after[0] - before[0], after[1] - before[1]
                row = {
                    "bench": name,
                    "mode": mode,
                    "read_requests": reqs_n,
                    "kib_per_request": round(sectors * 512 / 1024 / reqs_n, 1) if reqs_n else None,
                }
                if name == "dsv4_restore":
                    d = got["dsv4_restore"]
                    keys = ("MBps", "fio_MBps", "ratio_to_fio", "round_MBps", "fresh_daemon_MBps", "pool_hugetlb_pages")
                    row.update({k: d[k] for k in keys if k in d})  # (fio's figures only where fio ran)
                else:
                    row.update({k: got[k] for k in got if "read" in k and not isinstance(got[k], dict)})
                runs.append(row)
    summary = {}
    for name in cmds:
        for mode in modes:
            rows = [x for x in runs if x["bench"] == name and x["mode"] == mode]
            key = "MBps" if name == "dsv4_restore" else "read_MBps"
            summary[f"{name}_{mode}_MBps_median"] = round(statistics.median(x[key] for x in rows), 1)
    return {"runs": runs, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.environ.get("KVTIER_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-mib", type=int, default=32)
    ap.add_argument("--benches", action="store_true", help="Also run daemon.py and store.py under never and advise.")
    ap.add_argument("--bench-rounds", type=int, default=3)
    ap.add_argument("--hugetlb-pages", type=int, default=400, help="Pages reserved for the hugetlb mode's runs.")
    args = ap.parse_args()
    host = {
        "shmem_enabled": hugepages.setting("shmem_enabled"),
        "enabled": hugepages.setting("enabled"),
        "shmem_enabled_2048kB": hugepages.setting("hugepages-2048kB/shmem_enabled"),
        "kernel": os.uname().release,
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-thp-", dir=args.dir) as d:
        work = Path(d)
        dev = block_device(work)
        if dev is not None:
            host["max_segments"] = int((dev / "queue/max_segments").read_text())
            host["max_sectors_kb"] = int((dev / "queue/max_sectors_kb").read_text())
        report: dict[str, object] = {
            "host": host,
            "targets": bench_targets(work, args.tokens, args.rounds, args.batch_mib),
        }
        if args.benches:
            report["benches"] = bench_both(work, args.bench_rounds, args.hugetlb_pages)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
