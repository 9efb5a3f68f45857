"""Segment files: names, the appender that owns the segment it writes, and the writer lock."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Callable

import lmdb

from kvtier.store.errors import StoreLocked
from kvtier.store.index import Index, SegmentEntry, u64_key
from kvtier.store.io import PosixBackend, SegmentFile

log = logging.getLogger(__name__)

SEGMENTS_DIR = "segments"
WRITER_LOCK = "writer.lock"
_NAME = re.compile(r"^([0-9a-f]{16})\.seg$")


def segment_name(seg_id: int) -> str:
    """Segment files are named only by a fixed-width hex id, never by request data."""
    return f"{seg_id:016x}.seg"


def parse_segment_name(name: str) -> int | None:
    m = _NAME.match(name)
    return int(m.group(1), 16) if m else None


def list_segments(seg_dir: str) -> list[int]:
    return sorted(i for i in (parse_segment_name(n) for n in os.listdir(seg_dir)) if i is not None)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriterLock:
    """flock on <root>/writer.lock: one appending daemon (and no rebuild) per store at a time."""

    def __init__(self, root: str) -> None:
        path = os.path.join(root, WRITER_LOCK)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self.fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise StoreLocked(
                    f"{path} is held by another writer: stop the kvtier daemon (or wait) and retry"
                ) from None
            raise

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclasses.dataclass(slots=True)
class Placement:
    seg_id: int
    file: SegmentFile
    offset: int


class Appender:
    """Appends records to segments it alone writes (flock held on each); rolls at `segment_bytes`."""

    def __init__(
        self,
        root: str,
        index: Index,
        backend: PosixBackend,
        segment_bytes: int,
        *,
        allocate: Callable[[], int] | None = None,
        seal: Callable[[int], None] | None = None,
    ) -> None:
        """`allocate` / `seal`: how a segment id is registered and sealed in the index (default: in a write
        transaction of this process; the verifier's relocator asks the daemon, `kvtier.store.decisions`)."""
        self.seg_dir = os.path.join(root, SEGMENTS_DIR)
        self.index = index
        self._allocate_id = allocate or (lambda: self.index.update(lambda txn: allocate_segment(self.index, txn)))
        self._seal_id = seal or (lambda seg_id: self.index.update(lambda txn: seal_segment(self.index, txn, seg_id)))
        self.backend = backend
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._file: SegmentFile | None = None
        self._seg_id = 0
        self._tail = 0
        self._batch: dict[int, tuple[SegmentFile, int]] = {}  # seg id -> (file, tail at batch start)
        self._rolled: list[SegmentFile] = []  # rolled away mid-batch: closed only when the batch ends

    @property
    def owned_segment(self) -> int:
        return self._seg_id

    def begin_batch(self) -> None:
        self._batch = {}

    def place(self, record_len: int) -> Placement:
        """Reserve record_len bytes at the tail (thread-safe); rolls to a new segment when this one is full."""
        with self._lock:
            if self._file is None or (self._tail and self._tail + record_len > self.segment_bytes):
                self._roll()
            assert self._file is not None
            self._batch.setdefault(self._seg_id, (self._file, self._tail))
            placement = Placement(self._seg_id, self._file, self._tail)
            self._tail += record_len
            return placement

    def end_batch(self) -> None:
        """Close segments rolled away during the batch (other threads may have been writing them until now)."""
        with self._lock:
            for file in self._rolled:
                file.close()
            self._rolled = []
            self._batch = {}

    def sync_batch(self) -> None:
        """fdatasync every segment the batch wrote (O_DIRECT and KvikIO writes are not durable without it)."""
        for file, _ in self._batch.values():
            file.sync()

    def rewind(self, *, abandon: bool) -> None:
        """Undo the batch's unacknowledged appends; abandon the segment if its sync state is unknown."""
        with self._lock:
            for seg_id, (file, start) in self._batch.items():
                try:
                    file.truncate(start)
                except OSError as exc:
                    log.warning("could not truncate segment %016x back to %d: %s", seg_id, start, exc)
                if seg_id == self._seg_id:
                    self._tail = start
            if abandon and self._file is not None:
                self._seal_current()

    def _roll(self) -> None:
        if self._file is not None:
            self._rolled.append(self._seal_current(close=False))
        while True:
            seg_id = self._allocate_id()
            path = os.path.join(self.seg_dir, segment_name(seg_id))
            file = self.backend.open(path, create=True, write=True)
            if not file.try_lock():
                file.close()
                continue
            fsync_dir(self.seg_dir)
            # A sealer may have sealed the entry between allocation and our lock: then take another id.
            with self.index.read() as txn:
                raw = txn.get(u64_key(seg_id), db=self.index.seg)
            if raw is not None and not SegmentEntry.unpack(raw).sealed:
                break
            file.close()
        self._file, self._seg_id, self._tail = file, seg_id, 0
        log.info("appending to segment %s", path)

    def _seal_current(self, *, close: bool = True) -> SegmentFile:
        seg_id, file = self._seg_id, self._file
        assert file is not None
        self._file, self._seg_id, self._tail = None, 0, 0
        self._seal_id(seg_id)
        if close:
            file.close()
        return file

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._seal_current()


def allocate_segment(index: Index, txn: lmdb.Transaction) -> int:
    """Register the next segment id, unsealed, for an appender to create and flock."""
    seg_id = index.get_meta_u64(txn, b"next_segment", 1)
    index.put_meta_u64(txn, b"next_segment", seg_id + 1)
    txn.put(u64_key(seg_id), SegmentEntry(sealed=False, created=time.time()).pack(), db=index.seg)
    return seg_id


def seal_segment(index: Index, txn: lmdb.Transaction, seg_id: int) -> bool:
    """Seal the segment if it is indexed and unsealed; whether this did."""
    db = index.seg
    raw = txn.get(u64_key(seg_id), db=db)
    if raw is None:
        return False
    entry = SegmentEntry.unpack(raw)
    if entry.sealed:
        return False
    txn.put(u64_key(seg_id), dataclasses.replace(entry, sealed=True).pack(), db=db)
    return True
