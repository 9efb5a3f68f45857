"""kvtier's disk store next to the stores a user would pick instead, holding the same objects; prints one JSON object.

Runs in the peers venv (`bench/.venv-peers`, which `bench/run_all.py` creates): python-diskcache,
LMCache 0.5.6's `LocalDiskBackend` (a `LocalCPUBackend` as allocator, `use_odirect`) and kvtier's
`DiskStore` each hold the same objects: the deepseek-v4-flash history objects (c4_main, c128_main,
indexer_k) of every hash block of a `--tokens` prefix, and the state objects (swa, c4_state,
c128_state) of a checkpoint every `--checkpoint-every` blocks; random payloads, each one stamped
with its own id. Per store, in a fresh process, on the same filesystem:

LMCache reads a file with O_DIRECT only when the object's buffer is a whole number of the filesystem's blocks
(its `read_file`), so its objects are allocated padded up to that (`padding_bytes`; its rates count the payload
bytes only). Its reads and the O_DIRECT opens among them are counted in its own code path during the cold reads
(`reads`, `odirect_reads`); `lmcache_odirect` says whether every one was O_DIRECT.

* write: every object, in batches (the truncation target alone, last); `ack` is when the store says it has them,
  `durable` adds an fsync of every file the store made (kvtier's write is durable when it returns: the two are equal);
* cold read: page cache of the store's files dropped (fsync + posix_fadvise DONTNEED), every object
  read back in batches and compared with what was written (`cold_read_cpu_s`: the store process's CPU seconds,
  every thread's, over the timed reads; `--cprofile DIR` writes a cProfile of them per store and round); kvtier
  reads into pools as a daemon's are, one per cache group carved into slots of the group's object size;
* integrity: one byte of a stored object flipped in the store's file, a second object's file
  truncated in the middle of its bytes, both read back: "detects", "returns wrong bytes silently"
  or "error";
* restart: a new process opens the same directory and reads the untouched objects back.

The raw device in the same run: `dd iflag=direct bs=4M` reading a file of every object's bytes back to back,
written once, page cache dropped first (`raw_device.dd_MBps`; each store's `cold_read_of_dd` is its cold read
over that), and the disk's limit: fio reading the same file with O_DIRECT through libaio at the request size and
queue depth of kvtier's large loads, into huge-page buffers where it can have them (`bench/fio_limit.py`, the
store section's limit too; `raw_device.fio_MBps`, and `raw_device.fio` says how; each store's
`cold_read_of_fio` is its cold read over that: what the disk leaves to gain). Without fio, or with `--no-fio`,
`raw_device.fio.missing` says why. And kvtier's layout with none of kvtier's work: every batch's byte
span in each segment read, cold, in kvtier's own piece size (2 MiB) of O_DIRECT reads all in flight at once
through native AIO, one batch after another, with no lookup, check or copy, after kvtier's cold read or (every
other round) before it (`kvtier.layout_read_MBps`; `cold_read_of_layout` is the cold read over it: what
kvtier's own work costs; `layout_read_of_fio` is it over fio: what reading a batch at a time costs).
`layout_over_peer` is that read over each peer's cold read: the most kvtier could be faster than the peer on
this disk with its layout, in batches of 32.

torch runs one intra-op thread in every store's process. Passes alternate between the stores
`--repeat` times, in reverse order every other round (dd and fio always between them, in turn first); each
store's best pass is reported, each raw read's best, and kvtier's throughput over each peer's (ratio > 1: kvtier
faster).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fio_limit import Geometry, HugeBuffers, described, fio_read, geometry  # noqa: E402
from fio_limit import missing as fio_missing  # noqa: E402
from pagecache import dd_direct_s, drop_cache_file, drop_cache_tree  # noqa: E402
from slots import slot_targets  # noqa: E402

from kvtier.core import GroupKind, ModelProfile, Reason, block_hashes, load_profile  # noqa: E402
from kvtier.core.tier import LoadRequest, ObjectKey  # noqa: E402
from kvtier.store import IndexEntry  # noqa: E402

MB = 1e6
BATCH = 32  # objects per write / read call, for every store
IO_THREADS = 4  # kvtier's io_threads and LMCache's disk_io_threads
STORES = ("kvtier", "diskcache", "lmcache")
DETECTS, SILENT, ERROR, CORRECT = "detects", "returns wrong bytes silently", "error", "returns the right bytes"


# ----------------------------------------------------------------------------------------------- workload


class Workload:
    """The objects every store holds: keys as kvtier names them, payloads as bytes (stamped with their index)."""

    def __init__(self, profile: ModelProfile, tokens: int, checkpoint_every: int, seed: int = 0) -> None:
        h = profile.hash_block_tokens
        blocks = tokens // h
        rng = np.random.default_rng(seed)
        hashes = block_hashes(profile.namespace, rng.integers(0, 129_280, blocks * h, dtype=np.int64), h)
        checkpoints = {b for b in range(blocks) if (b + 1) % checkpoint_every == 0 or b == blocks - 1}
        self.profile = profile
        self.tokens = blocks * h
        self.keys: list[ObjectKey] = []
        self.payloads: list[bytes] = []
        self.digests: dict[str, bytes] = {g.name: profile.layout(g).digest for g in profile.groups}
        templates = {
            g.name: bytearray(rng.integers(0, 256, g.object_bytes(h), dtype=np.uint8).tobytes()) for g in profile.groups
        }
        for b in range(blocks):
            for g in profile.groups:
                if g.kind is GroupKind.STATE and b not in checkpoints:
                    continue
                self.keys.append(ObjectKey(profile.namespace, hashes[b], g.name, g.form))
                t = templates[g.name]
                t[:8] = len(self.payloads).to_bytes(8, "little")
                self.payloads.append(bytes(t))
        self.total_bytes = sum(map(len, self.payloads))
        # integrity targets: a history object in the middle (flip) and the last object, written alone after the
        # others (truncate: for kvtier the last record of its segment, so no other object is cut with it; written in
        # a batch it could lie before the batch's other records, whose extents are written in parallel)
        self.flip_index = next(
            i
            for i, k in enumerate(self.keys)
            if k.group == profile.groups[0].name and k.block_hash == hashes[blocks // 2]
        )
        self.trunc_index = len(self.keys) - 1

    def describe(self) -> dict:
        per_group: dict[str, dict[str, int]] = {}
        for k, p in zip(self.keys, self.payloads):
            c = per_group.setdefault(k.group, {"objects": 0, "bytes_each": len(p)})
            c["objects"] += 1
        return {
            "profile": self.profile.name,
            "tokens": self.tokens,
            "objects": len(self.keys),
            "bytes": self.total_bytes,
            "groups": per_group,
        }

    def batches(self, indices: Sequence[int]) -> Iterator[list[int]]:
        for start in range(0, len(indices), BATCH):
            yield list(indices[start : start + BATCH])

    def write_batches(self) -> Iterator[list[int]]:
        """Every object in batches, the truncation target alone and last."""
        yield from self.batches([i for i in range(len(self.keys)) if i != self.trunc_index])
        yield [self.trunc_index]


def as_tensor(payload: bytes) -> torch.Tensor:
    """A read-only uint8 view of the bytes (no copy); the stores only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


def fsync_tree(path: Path) -> None:
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def truncate(path: str, length: int) -> None:
    os.truncate(path, length)
    drop_cache_file(path)


def verdict(store: KvtierStore | DiskcacheStore | LmcacheStore, i: int) -> str:
    """What reading a damaged object gives: the store refusing it (a miss or its own error) or bytes."""
    try:
        got = store.read([i])[0]
    except Exception as exc:
        return f"{ERROR} ({type(exc).__name__})"
    if got is None:
        return f"{DETECTS} ({store.miss_label})"
    return CORRECT if got == store.w.payloads[i] else SILENT


# ----------------------------------------------------------------------------------------------- stores


class KvtierStore:
    """kvtier.store.DiskStore: LMDB index + checksummed, aligned segments; store_many / load_into batches."""

    name = "kvtier"

    def __init__(self, root: Path, w: Workload, *, writer: bool) -> None:
        from kvtier.store import DiskStore, StoreConfig

        self.root, self.w = root, w
        self.store = DiskStore(str(root), StoreConfig(io_threads=IO_THREADS), writer=writer)
        if writer:
            self.store.register_namespace(w.profile.version)
        # Targets as a daemon's are: a pool per cache group, carved into slots of that group's object size
        # (bench/slots.py), a batch's objects of a group in consecutive slots of its pool; faulted in now (not timed),
        # as LMCache's allocator buffer is (zeroed at start). Not a slot of the largest object's size per object:
        # no daemon's pool spreads a batch so, and the same reads into such slots took longer.
        sizes = {k.group: len(p) for k, p in zip(w.keys, w.payloads)}
        most = {g: max(sum(w.keys[i].group == g for i in idx) for idx in w.batches(range(len(w.keys)))) for g in sizes}
        self.pools = {g: slot_targets([sizes[g]] * most[g]) for g in sizes}

    @property
    def details(self) -> dict:
        return {"io_backend": self.store.io_backend, "durable_on_ack": True, "checksums": "xxh3_128 per record"}

    def write(self, idx: list[int]) -> None:
        w = self.w
        self.store.store_many([(w.keys[i], as_tensor(w.payloads[i]), w.digests[w.keys[i].group]) for i in idx])

    def read(self, idx: list[int]) -> list[bytes | None]:
        w = self.w
        outs = self._outs(idx)
        reasons = self.store.load_into(
            [LoadRequest(w.keys[i], o, w.digests[w.keys[i].group]) for i, o in zip(idx, outs)]
        )
        self.last_reasons = reasons
        return [o.numpy().tobytes() if r is Reason.OK else None for r, o in zip(reasons, outs)]

    @property
    def miss_label(self) -> str:
        why = ", ".join(sorted({r.label for r in self.last_reasons if r is not Reason.OK}))
        return f"load answers {why}: RECOMPUTE, record quarantined"

    def read_view(self, idx: list[int]) -> list[torch.Tensor | None]:
        """Like read, without the copy to bytes (the timed path; the caller compares in place)."""
        w = self.w
        outs = self._outs(idx)
        reasons = self.store.load_into(
            [LoadRequest(w.keys[i], o, w.digests[w.keys[i].group]) for i, o in zip(idx, outs)]
        )
        return [o if r is Reason.OK else None for r, o in zip(reasons, outs)]

    def _outs(self, idx: list[int]) -> list[torch.Tensor]:
        """A target per object of the batch: the next free slot of its group's pool."""
        taken: dict[str, int] = {}
        outs = []
        for i in idx:
            g = self.w.keys[i].group
            outs.append(self.pools[g][taken.get(g, 0)])
            taken[g] = taken.get(g, 0) + 1
        return outs

    def _entries(self) -> dict[ObjectKey, IndexEntry]:
        """Every stored object's index entry, by key (one scan of the namespace's records)."""
        ns = self.w.keys[0].namespace
        return {info.key: info.entry for info in self.store.iter_records(namespace=ns, limit=len(self.w.keys) + 1)}

    def _entry(self, i: int) -> IndexEntry:
        entry = self._entries().get(self.w.keys[i])
        if entry is None:
            raise LookupError(f"kvtier has no record for object {i}")
        return entry

    def locate(self, i: int) -> tuple[str, int, int]:
        """(file, offset of the payload in it, payload bytes)."""
        from kvtier.store import SEGMENTS_DIR, segment_name

        e = self._entry(i)
        return str(self.root / SEGMENTS_DIR / segment_name(e.segment)), e.payload_offset, e.payload_len

    def layout_read_s(self, batches: Sequence[list[int]]) -> float | None:
        """Seconds to read every batch's span of each segment its records lie in (4 KiB-aligned), cold, in
        reads of kvtier's piece size all in flight at once, a batch after the previous one is in; nothing checked
        or copied (`kvtier.store.SpanReader`). None where native AIO is not to be had."""
        from kvtier.store import SpanReader

        entries = self._entries()
        spans: list[dict[int, tuple[int, int]]] = []
        for idx in batches:
            per: dict[int, tuple[int, int]] = {}
            for i in idx:
                e = entries[self.w.keys[i]]
                lo, hi = per.get(e.segment, (e.offset, e.offset + e.record_len))
                per[e.segment] = (min(lo, e.offset), max(hi, e.offset + e.record_len))
            spans.append({seg: (lo - lo % 4096, -(-hi // 4096) * 4096) for seg, (lo, hi) in per.items()})
        reader = SpanReader.open(str(self.root), {seg for per in spans for seg in per})
        if reader is None:
            return None
        try:
            target = memoryview(
                slot_targets([max(sum(hi - lo for lo, hi in per.values()) for per in spans)])[0].numpy()
            )
            drop_cache_tree(self.root)
            took = 0.0
            for per in spans:
                t0 = time.perf_counter()
                reader.read(per, target)
                took += time.perf_counter() - t0
            return took
        finally:
            reader.close()

    def close(self) -> None:
        self.store.close()


class DiskcacheStore:
    """python-diskcache `Cache`: SQLite index, values >= 32 KiB as one file each (raw bytes, no pickling)."""

    name = "diskcache"
    miss_label = "miss"

    def __init__(self, root: Path, w: Workload, *, writer: bool) -> None:
        import diskcache

        self.root, self.w = root, w
        self.cache = diskcache.Cache(str(root), size_limit=1 << 40)

    @property
    def details(self) -> dict:
        import diskcache

        return {"version": diskcache.__version__, "durable_on_ack": False, "checksums": None}

    def _key(self, i: int) -> bytes:
        k = self.w.keys[i]
        return k.namespace + k.block_hash + k.group.encode()

    def write(self, idx: list[int]) -> None:
        for i in idx:
            self.cache.set(self._key(i), self.w.payloads[i])

    def read(self, idx: list[int]) -> list[bytes | None]:
        return [self.cache.get(self._key(i)) for i in idx]

    read_view = read

    def locate(self, i: int) -> tuple[str, int, int]:
        with self.cache.get(self._key(i), read=True) as f:
            return f.name, 0, len(self.w.payloads[i])

    def close(self) -> None:
        self.cache.close()


class LmcacheStore:
    """LMCache 0.5.6 `LocalDiskBackend` driven standalone: `LocalCPUBackend` allocates, one file per object."""

    name = "lmcache"
    miss_label = "miss"

    def __init__(self, root: Path, w: Workload, *, writer: bool) -> None:
        logging.getLogger("lmcache").setLevel(logging.ERROR)
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.root, self.w = root, w
        self.fmt = MemoryFormat.KV_2LTD
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=w.profile.hash_block_tokens,
            local_cpu=False,
            max_local_cpu_size=1.0,
            local_disk=str(root),
            max_local_disk_size=64.0,
            extra_config={"use_odirect": True, "disk_io_threads": IO_THREADS},
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        biggest = max(map(len, w.payloads))
        allocator = MixedMemoryAllocator(max(256 << 20, 2 * BATCH * biggest))
        allocator.buffer.zero_()  # fault the staging buffer in now, as pinning it would on a GPU host (not timed)
        self.cpu = LocalCPUBackend(config, memory_allocator=allocator)
        self.disk = LocalDiskBackend(config, self.loop, self.cpu, dst_device="cpu")
        self.ckeys = [CacheEngineKey(w.profile.name, 1, 0, _chunk_hash(k), torch.uint8) for k in w.keys]
        self.done = threading.Semaphore(0)
        # LMCache reads (and writes) a file with O_DIRECT only when the object's buffer is a whole number of the
        # filesystem's blocks (`read_file`: len(buffer) % os_disk_bs == 0), else buffered: every object is
        # allocated padded up to that, so all of them take its O_DIRECT path.
        self.bs = self.disk.os_disk_bs
        self.sizes = [-(-len(p) // self.bs) * self.bs for p in w.payloads]
        self.reads = self.odirect_reads = 0
        self._count_reads()

    def _count_reads(self) -> None:
        """Count LMCache's reads, and those it opened with O_DIRECT, in its own code: its `read_file` is wrapped,
        and the `os` its module sees is this process's `os` with `open` counting O_RDONLY | O_DIRECT opens of
        files under the store's root. A read that went buffered shows as a read with no O_DIRECT open."""
        from lmcache.v1.storage_backend import local_disk_backend

        lock, store, root = threading.Lock(), self, str(self.root)
        read_file = self.disk.read_file

        def counted_read(key, buffer, path):
            with lock:
                store.reads += 1
            return read_file(key, buffer, path)

        class CountingOs:
            def __getattr__(self, name: str):
                return getattr(os, name)

            @staticmethod
            def open(path, flags, *args, **kwargs):
                if flags & os.O_DIRECT and not flags & (os.O_WRONLY | os.O_RDWR) and str(path).startswith(root):
                    with lock:
                        store.odirect_reads += 1
                return os.open(path, flags, *args, **kwargs)

        self.disk.read_file = counted_read
        local_disk_backend.os = CountingOs()

    def read_counts(self) -> dict:
        return {"reads": self.reads, "odirect_reads": self.odirect_reads}

    @property
    def details(self) -> dict:
        import lmcache

        return {
            "version": getattr(lmcache, "__version__", "0.5.6"),
            "durable_on_ack": False,
            "checksums": None,
            "use_odirect": self.disk.use_odirect,
            "padded_to": self.bs,
            "padding_bytes": sum(self.sizes) - sum(map(len, self.w.payloads)),
        }

    def write(self, idx: list[int]) -> None:
        keys, objs = [], []
        for i in idx:
            obj = self.cpu.allocate(torch.Size([self.sizes[i]]), torch.uint8, self.fmt)
            obj.tensor[: len(self.w.payloads[i])].copy_(as_tensor(self.w.payloads[i]))
            keys.append(self.ckeys[i])
            objs.append(obj)
        self.disk.batched_submit_put_task(keys, objs, on_complete_callback=lambda _k: self.done.release())
        for obj in objs:
            obj.ref_count_down()  # the put task holds its own reference until written
        for _ in idx:  # the ack: each object is on disk and in the backend's index
            if not self.done.acquire(timeout=120):
                raise TimeoutError("LMCache did not finish a put in 120 s")

    def read(self, idx: list[int]) -> list[bytes | None]:
        out = []
        for i, obj in zip(idx, self._get(idx)):
            out.append(None if obj is None else bytes(obj.byte_array[: len(self.w.payloads[i])]))
            if obj is not None:
                obj.ref_count_down()
        return out

    def read_view(self, idx: list[int]) -> list[torch.Tensor | None]:
        objs = self._get(idx)
        self._held = objs  # released by release_views()
        return [None if o is None else o.tensor[: len(self.w.payloads[i])] for i, o in zip(idx, objs)]

    def release_views(self) -> None:
        for o in getattr(self, "_held", []):
            if o is not None:
                o.ref_count_down()
        self._held = []

    def _get(self, idx: list[int]):
        keys = [self.ckeys[i] for i in idx]
        found = [k for k in keys if self.disk.contains(k)]
        got = dict(zip(found, self.disk.batched_get_blocking(found))) if found else {}
        return [got.get(k) for k in keys]

    def locate(self, i: int) -> tuple[str, int, int]:
        return self.disk.dict[self.ckeys[i]].path, 0, len(self.w.payloads[i])

    def close(self) -> None:
        self.disk.close()
        self.cpu.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _chunk_hash(key: ObjectKey) -> int:
    """LMCache keys a chunk by an int: the block hash and the group, folded to 64 bits."""
    return int.from_bytes(hashlib.blake2b(key.block_hash + key.group.encode(), digest_size=8).digest(), "little")


STORE_CLASSES = {c.name: c for c in (KvtierStore, DiskcacheStore, LmcacheStore)}


# ----------------------------------------------------------------------------------------------- phases


def phase_main(store_name: str, root: Path, w: Workload, layout_first: bool = False, profile: str = "") -> dict:
    """Write, cold read (verified), then flip a byte and truncate a file and read both back. kvtier's layout read
    goes after the cold read, or before it with `layout_first` (the rounds alternate: a disk may serve bytes read
    a moment ago faster)."""
    s = STORE_CLASSES[store_name](root, w, writer=True)
    try:
        everything = list(range(len(w.keys)))
        t0 = time.perf_counter()
        for idx in w.write_batches():
            s.write(idx)
        ack_s = time.perf_counter() - t0
        fsync_tree(root)
        durable_s = time.perf_counter() - t0
        layout = (lambda: s.layout_read_s(list(w.batches(everything)))) if isinstance(s, KvtierStore) else None
        layout_s = layout() if layout is not None and layout_first else None
        drop_cache_tree(root)

        read_s, cpu_s, wrong, missing = 0.0, 0.0, 0, 0
        prof = cProfile.Profile() if profile else None
        for idx in w.batches(everything):
            c0, t0 = time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            views = s.read_view(idx)
            if prof is not None:
                prof.disable()
            read_s += time.perf_counter() - t0
            cpu_s += time.process_time() - c0
            for i, v in zip(idx, views):
                if v is None:
                    missing += 1
                elif (bytes(v) if isinstance(v, bytes) else v.numpy().tobytes()) != w.payloads[i]:
                    wrong += 1
            if hasattr(s, "release_views"):
                s.release_views()

        cold_counts = s.read_counts() if isinstance(s, LmcacheStore) else {}
        if prof is not None:
            prof.dump_stats(profile)
        if layout is not None and not layout_first:
            layout_s = layout()

        flip_path, flip_off, flip_len = s.locate(w.flip_index)
        flip_byte(flip_path, flip_off + flip_len // 2)
        trunc_path, trunc_off, trunc_len = s.locate(w.trunc_index)
        truncate(trunc_path, trunc_off + trunc_len // 2)
        drop_cache_tree(root)
        flipped = verdict(s, w.flip_index)
        truncated = verdict(s, w.trunc_index)
        details = s.details
    finally:
        s.close()
    return {
        "ack_s": ack_s,
        "durable_s": durable_s,
        "cold_read_s": read_s,
        "cold_read_cpu_s": cpu_s,
        "layout_read_s": layout_s,
        "read_wrong": wrong,
        "read_missing": missing,
        "flipped_byte": flipped,
        "truncated_file": truncated,
        "details": {**details, **cold_counts},
    }


def phase_restart(store_name: str, root: Path, w: Workload) -> dict:
    """A new process on the same directory: how many of the untouched objects come back, and right."""
    s = STORE_CLASSES[store_name](root, w, writer=False)
    try:
        untouched = [i for i in range(len(w.keys)) if i not in (w.flip_index, w.trunc_index)]
        found = right = 0
        for idx in w.batches(untouched):
            for i, got in zip(idx, s.read(idx)):
                found += got is not None
                right += got == w.payloads[i]
    finally:
        s.close()
    return {"untouched": len(untouched), "found": found, "correct": right}


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # copies on 2 shared cores: intra-op threads only contend with the stores' I/O threads
    w = Workload(load_profile(args.profile), args.tokens, args.checkpoint_every)
    if args.phase == "main":
        result = phase_main(args.store, Path(args.root), w, args.layout_first, args.profile_to)
    else:
        result = phase_restart(args.store, Path(args.root), w)
    Path(args.out).write_text(json.dumps(result))


def run_child(store: str, phase: str, root: Path, args: argparse.Namespace, *extra: str) -> dict:
    out = root.parent / f"{store}-{phase}.json"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--store",
        store,
        "--phase",
        phase,
        "--root",
        str(root),
        "--out",
        str(out),
        "--profile",
        args.profile,
        "--tokens",
        str(args.tokens),
        "--checkpoint-every",
        str(args.checkpoint_every),
        *extra,
    ]
    env = dict(os.environ, LMCACHE_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    res = subprocess.run(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=args.timeout
    )
    if res.returncode != 0:
        tail = res.stderr.strip().splitlines()[-3:]
        return {"error": f"{store} {phase} exited {res.returncode}: " + " | ".join(tail)}
    return json.loads(out.read_text())


def raw_file(path: Path, w: Workload) -> Path:
    """Every object's bytes back to back in one file, durable (the dd baseline reads it)."""
    with open(path, "wb") as f:
        for p in w.payloads:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())
    return path


def dd_pass(raw: Path) -> float:
    """Seconds for dd O_DIRECT to read the raw file cold."""
    drop_cache_file(raw)
    return dd_direct_s(raw)


def fio_pass(raw: Path, geo: Geometry) -> dict:
    """fio reading the raw file cold at kvtier's request size and depth (`bench/fio_limit.py`): its MB/s and the
    memory it read into; where fio fails, why (the stores' figures still stand: the run reports the limit missing,
    not another one). Its huge pages are taken for this read alone: held across the stores' passes, a reservation
    of the host's hugetlb pages is what another process setting vm.nr_hugepages meanwhile takes away."""
    with HugeBuffers(geo) as buffers:
        try:
            got = fio_read([(raw, 0, raw.stat().st_size // 4096 * 4096)], geo, buffers)
            return {"MBps": got.MBps, "memory": buffers.memory}
        except RuntimeError as exc:
            return {"error": str(exc), "memory": buffers.memory}


def summarize(
    store: str, passes: list[dict], restart: dict, total: int, dd_mbps: float, fio_mbps: float | None
) -> dict:
    good = [p for p in passes if "error" not in p]
    if not good:
        return {"error": passes[-1]["error"]}
    best = lambda k: min(p[k] for p in good)  # noqa: E731
    last = good[-1]
    r = (
        restart
        if "error" in restart
        else {
            **restart,
            "finds_its_data": restart["correct"] == restart["untouched"],
        }
    )
    layout = {}
    if all(p.get("layout_read_s") for p in good):
        layout = {
            "layout_read_MBps": round(total / best("layout_read_s") / MB, 1),
            "cold_read_of_layout": round(best("layout_read_s") / best("cold_read_s"), 2),
        }
        if fio_mbps is not None:  # how near the disk's limit a batch-at-a-time read gets with no work of kvtier's
            layout["layout_read_of_fio"] = round(total / best("layout_read_s") / MB / fio_mbps, 2)
    return {
        "write_ack_MBps": round(total / best("ack_s") / MB, 1),
        "write_durable_MBps": round(total / best("durable_s") / MB, 1),
        "cold_read_MBps": round(total / best("cold_read_s") / MB, 1),
        "cold_read_of_dd": round(total / best("cold_read_s") / MB / dd_mbps, 2),
        # the store process's CPU seconds (every thread's) over its cold reads, least of the rounds
        "cold_read_cpu_s": round(best("cold_read_cpu_s"), 3),
        **({} if fio_mbps is None else {"cold_read_of_fio": round(total / best("cold_read_s") / MB / fio_mbps, 2)}),
        **layout,
        "read_back_correct": all(p["read_wrong"] == 0 and p["read_missing"] == 0 for p in good),
        "flipped_byte": last["flipped_byte"],
        "truncated_file": last["truncated_file"],
        "restart": r,
        **last["details"],
        **(
            {k: sum(p["details"][k] for p in good) for k in ("reads", "odirect_reads")}
            if "reads" in last["details"]
            else {}
        ),
    }


def ratios(stores: dict[str, dict]) -> dict:
    """kvtier's throughput over each peer's (> 1: kvtier faster)."""
    k = stores.get("kvtier", {})
    out = {}
    for name, s in stores.items():
        if name == "kvtier" or "error" in s or "error" in k:
            continue
        out[name] = {m: round(k[m] / s[m], 2) for m in ("write_ack_MBps", "write_durable_MBps", "cold_read_MBps")}
    return out


def layout_over_peer(stores: dict[str, dict]) -> dict:
    """kvtier's layout read, with none of its work, over each peer's cold read: the bound of the cold read ratio."""
    k = stores.get("kvtier", {})
    if "layout_read_MBps" not in k:
        return {}
    return {
        name: round(k["layout_read_MBps"] / s["cold_read_MBps"], 2)
        for name, s in stores.items()
        if name != "kvtier" and "error" not in s
    }


def lmcache_odirect(stores: dict[str, dict]) -> dict:
    """Whether LMCache read every object of its cold reads with O_DIRECT, as counted in its own code path."""
    lm = stores.get("lmcache", {})
    if "reads" not in lm:
        return {}
    return {"lmcache_odirect": lm["reads"] > 0 and lm["odirect_reads"] == lm["reads"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="deepseek-v4-flash")
    ap.add_argument("--tokens", type=int, default=65536, help="Prefix length whose objects every store holds.")
    ap.add_argument("--checkpoint-every", type=int, default=64, help="Hash blocks between state checkpoints.")
    ap.add_argument("--stores", nargs="+", default=list(STORES), choices=STORES)
    ap.add_argument("--repeat", type=int, default=2, help="Alternate the stores' passes; report each one's best.")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="Directory on the filesystem to measure.")
    ap.add_argument("--timeout", type=float, default=300, help="Seconds one store's phase may take.")
    ap.add_argument(
        "--no-fio",
        action="store_true",
        help="Leave the fio limit out (raw_device.fio says so); fio reserves hugetlb pages as root.",
    )
    ap.add_argument(
        "--cprofile",
        metavar="DIR",
        help="Write a cProfile of each store's timed cold reads to DIR/<store>-<round>.prof (pstats).",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-to", default="", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("main", "restart"), help=argparse.SUPPRESS)
    ap.add_argument("--layout-first", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    w = Workload(load_profile(args.profile), args.tokens, args.checkpoint_every)
    if args.cprofile:
        Path(args.cprofile).mkdir(parents=True, exist_ok=True)
    passes: dict[str, list[dict]] = {s: [] for s in args.stores}
    restarts: dict[str, dict] = {}
    dd_s: list[float] = []
    fio_r: list[dict] = []
    no_fio = "left out (--no-fio)" if args.no_fio else fio_missing()
    geo = geometry()
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir=args.dir))
    try:
        raw = raw_file(work / "raw.bin", w)
        for r in range(args.repeat):
            order = args.stores if r % 2 == 0 else args.stores[::-1]
            for k, store in enumerate(order):
                if k == len(order) // 2:  # the raw device between the stores: dd, then fio (odd rounds: fio first)
                    if r % 2 == 0:
                        dd_s.append(dd_pass(raw))
                    if no_fio is None:
                        fio_r.append(fio_pass(raw, geo))
                    if r % 2 == 1:
                        dd_s.append(dd_pass(raw))
                root = work / f"{store}-{r}"
                extra = ["--layout-first"] if r % 2 else []
                if args.cprofile:
                    extra += ["--profile-to", str(Path(args.cprofile).resolve() / f"{store}-{r}.prof")]
                passes[store].append(run_child(store, "main", root, args, *extra))
                if r == args.repeat - 1:
                    restarts[store] = (
                        run_child(store, "restart", root, args)
                        if "error" not in passes[store][-1]
                        else {"error": "no store to restart"}
                    )
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    dd_mbps = w.total_bytes / min(dd_s) / MB
    fio_best = max((f for f in fio_r if "MBps" in f), key=lambda f: f["MBps"], default=None)
    fio_failed = [f["error"] for f in fio_r if "error" in f]
    fio_mbps = None if fio_best is None else fio_best["MBps"]
    stores = {s: summarize(s, passes[s], restarts[s], w.total_bytes, dd_mbps, fio_mbps) for s in args.stores}
    fio: dict = (
        {"missing": no_fio or f"fio failed in every round: {fio_failed[-1]}"}
        if fio_best is None
        else described(
            geo,
            fio_best["memory"],
            "fio --rw=read of the same file as dd, cold (O_DIRECT), at kvtier's request size and depth, "
            "best of the rounds",
            **({"failed_rounds": fio_failed} if fio_failed else {}),
        )
    )
    print(
        json.dumps(
            {
                "workload": w.describe(),
                "raw_device": {
                    "dd_MBps": round(dd_mbps, 1),
                    "what": "dd iflag=direct bs=4M, every object's bytes in one file, cold, best of the rounds",
                    **({} if fio_mbps is None else {"fio_MBps": round(fio_mbps, 1)}),
                    "fio": fio,
                },
                "batch": BATCH,
                "io_threads": IO_THREADS,
                "repeat": args.repeat,
                "stores": stores,
                "kvtier_over_peer": ratios(stores),
                "layout_over_peer": layout_over_peer(stores),
                **lmcache_odirect(stores),
            }
        )
    )


if __name__ == "__main__":
    main()
