"""Segment I/O behind one interface: KvikIO (GDS), POSIX O_DIRECT, or buffered where O_DIRECT is refused."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib.util
import logging
import mmap
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvtier.core import hugepages
from kvtier.core.layout import DISK_ALIGNMENT
from kvtier.store.errors import StoreError

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

_FLOCK = struct.Struct("@hhqqi4x")  # struct flock on Linux (64-bit off_t): type, whence, start, len, pid


def lock_holder(fd: int, start: int = 0, length: int = 0) -> int | None:
    """The pid of a process holding a POSIX lock on the file's bytes [start, start + length) (length 0: to the
    end), or None. F_GETLK takes no lock, so the query can never wait; this process's own locks are not seen."""
    got = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    kind, _, _, _, pid = _FLOCK.unpack(got)
    return None if kind == fcntl.F_UNLCK else pid


def replace_whole(path: str, partial: str, body: bytes) -> None:
    """Write `body` to `partial`, then rename that to `path`: a reader of `path` sees the old file or the new one
    whole, also when the writer is stopped or dies half way (what it left keeps the partial name). No sync: what
    must survive a crash is not written this way."""
    with open(partial, "wb") as f:
        f.write(body)
    os.replace(partial, path)


# How much of a file `cut_down` frees per synced cut (bench/segment_delete.py measures the steps against none)
UNLINK_STEP_BYTES = 16 << 20


def cut_down(fd: int, size: int, step: int = UNLINK_STEP_BYTES) -> None:
    """Cut the file open at `fd` from its end, `step` bytes at a time, each cut synced, until at most `step` bytes
    past `size` are left (the caller frees those: its own last truncate, or the unlink). Why: a filesystem mounted
    with online discard (`-o discard`) discards the extents a file frees when its journal commits them, in that
    commit; a segment's worth freed at once is one long discard queued in front of the store's reads and of every
    fdatasync that waits on the commit. A synced cut commits one step's extents. A crash part way leaves the file
    shorter, whole up to its new end."""
    at = os.fstat(fd).st_size
    while at - size > step:
        at -= step
        os.ftruncate(fd, at)
        os.fsync(fd)


def unlink_in_steps(path: str, step: int = UNLINK_STEP_BYTES) -> bool:
    """Unlink a file after cutting it down in synced steps (`cut_down`); False where it was already gone. A crash
    part way leaves it shorter: the caller deletes it again later. A file this process may unlink but not write (its
    directory is writable to it, the file is another user's) is unlinked whole, as before there were steps."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except PermissionError:
        pass
    else:
        try:
            cut_down(fd, 0, step)
        finally:
            os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


log = logging.getLogger(__name__)

_MIN_BUFFER = 64 * 1024
_SMALL_ALIGN = 512  # the smallest logical block size
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
# A read larger than twice this is cut into pieces of about this size, read concurrently: one multi-megabyte read
# keeps a single request in flight, which leaves an SSD (or a virtual disk) idle between its parts. DSV4 objects
# (bench/peers.py's batches of 32, one multi-megabyte run each) read faster in pieces of a few MiB than in one read;
# a disk already busy with many runs (a large restore's) gains little.
SPLIT_BYTES = 2 << 20
SPLIT_THREADS = 4  # pieces in flight beside the caller's own, per process (shared by every open segment)


class AlignedBuffer:
    """Page-aligned private anonymous memory usable by O_DIRECT, viewed as a memoryview and a uint8 tensor; from
    2 MiB on, on huge pages where the kernel gives them (kvtier.core.hugepages: larger requests per read)."""

    __slots__ = ("_map", "_tensor", "addr", "capacity", "mv")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mv = memoryview(self._map)
        self._tensor: torch.Tensor | None = None
        # for memmove/memset without a Python-level copy; the address is the mapping's for its whole life
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        if capacity >= hugepages.HUGE_PAGE:  # before the first touch: pages are chosen when faulted in
            hugepages.advise_huge(self.addr, capacity)

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer as a uint8 tensor, made at first use: the store's O_DIRECT probe, run before a daemon
        listens, uses a buffer without loading torch."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._tensor


class BufferPool:
    """Reusable aligned buffers by power-of-two size class, so the hot path does not allocate."""

    def __init__(self, retain_bytes: int) -> None:
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._retained = 0
        self._retain_bytes = retain_bytes
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> AlignedBuffer:
        cap = max(_MIN_BUFFER, 1 << (nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(cap)
            if free:
                self._retained -= cap
                return free.pop()
        return AlignedBuffer(cap)

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            if self._retained + buf.capacity <= self._retain_bytes:
                self._free.setdefault(buf.capacity, []).append(buf)
                self._retained += buf.capacity


class SegmentFile:
    """One open segment file; positional, thread-safe reads and writes of aligned buffers."""

    __slots__ = ("device_handle", "fd", "path")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.device_handle: Any = None

    def pwrite_all(self, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            n = os.pwritev(self.fd, [data[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.ENOSPC, "short write", self.path)
            done += n

    def pread_into(self, buf: memoryview, offset: int) -> int:
        """Fill buf from offset; returns bytes read (less than len(buf) only at end of file)."""
        return self.preadv_into([buf], offset)

    def preadv_into(self, views: list[memoryview], offset: int) -> int:
        """Fill the views in order from offset; returns bytes read (fewer than they hold only at end of file). A
        large read goes as SPLIT_BYTES pieces in parallel (the caller reads the first), each a scattered read."""
        pieces = split_read(views, offset)
        if len(pieces) == 1:
            return self._preadv(views, offset)
        pool = _split_pool()
        futures: list[Future[int]] = []
        try:
            for piece_views, at, _ in pieces[1:]:
                futures.append(pool.submit(self._preadv, piece_views, at))
            got = [self._preadv(pieces[0][0], pieces[0][1])]
        finally:  # every piece finished before the caller may reuse (or free) the buffers they fill
            for f in futures:
                f.exception()
        return readable(pieces, got + [f.result() for f in futures])[0]

    def _preadv(self, views: list[memoryview], offset: int) -> int:
        """One scattered read per IOV_MAX views, in order, resuming after a short read until end of file."""
        done = 0
        while views:
            n = os.preadv(self.fd, views[:_IOV_MAX], offset + done)
            if n == 0:
                break
            done += n
            views = skip_bytes(views, n)
        return done

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def try_lock(self) -> bool:
        """Exclusive flock (per open file, so a probe in the same process conflicts too); False if held."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def split_read(
    views: list[memoryview], offset: int, piece: int = SPLIT_BYTES
) -> list[tuple[list[memoryview], int, int]]:
    """Cut a scattered read into consecutive pieces of about `piece` bytes and at most IOV_MAX views: (views, file
    offset, bytes) each; one piece (the views as given) when it is not more than twice that size and count. A view
    is cut only at a multiple of `piece` from its start, so an O_DIRECT piece keeps the address and offset
    alignment its view had. (A native AIO read is one scattered read: the kernel refuses more than IOV_MAX views.)"""
    total = sum(len(v) for v in views)
    if total <= 2 * piece and len(views) <= _IOV_MAX:
        return [(views, offset, total)]
    pieces: list[tuple[list[memoryview], int, int]] = []
    cur: list[memoryview] = []
    start = at = offset
    for v in views:
        for cut in range(0, len(v), piece):
            chunk = v[cut : cut + piece]
            cur.append(chunk)
            at += len(chunk)
            if at - start >= piece or len(cur) == _IOV_MAX:
                pieces.append((cur, start, at - start))
                cur, start = [], at
    if cur:
        pieces.append((cur, start, at - start))
    return pieces


def skip_bytes(views: list[memoryview], n: int) -> list[memoryview]:
    """The views with their first n bytes dropped (after a read that filled that much of them)."""
    out: list[memoryview] = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def readable(pieces: list[tuple[list[memoryview], int, int]], got: list[int]) -> tuple[int, bool]:
    """Bytes read from the start of a split read so far (`got`: per piece the bytes read, -1 while in flight), up
    to the first piece in flight or cut short by end of file (what follows it is not contiguous with what was
    read); and whether every piece is in."""
    done = 0
    for k, ((_, _, size), n) in enumerate(zip(pieces, got)):
        if n < 0:
            return done, False
        done += n
        if n < size:
            return done, min(got[k + 1 :], default=0) >= 0
    return done, True


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _split_pool() -> ThreadPoolExecutor:
    """The process's threads for split reads."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(SPLIT_THREADS, thread_name_prefix="kvtier-split-read")
        return _pool


def _forget_pool_in_child() -> None:
    """A forked child inherits no threads (and maybe a lock some thread held): it makes its own pool."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


class PosixBackend:
    """os.preadv/os.pwritev on page-aligned buffers, with O_DIRECT unless the filesystem refuses it."""

    gpu_direct = False  # reads into and writes from device memory (GDS)

    def __init__(self, direct: bool, align: int = DISK_ALIGNMENT) -> None:
        self.direct = direct
        self.name = "odirect" if direct else "buffered"
        # What a read straight into caller memory needs: address and length multiples of this (O_DIRECT: what
        # the probe found the device takes, 512 or 4096; buffered: anything).
        self.direct_align = align if direct else 1

    def open(self, path: str, *, create: bool = False, write: bool = False) -> SegmentFile:
        flags = os.O_CLOEXEC | (os.O_RDWR if write or create else os.O_RDONLY)
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        if self.direct:
            flags |= os.O_DIRECT
        return SegmentFile(path, os.open(path, flags, 0o644))

    def device_io(self, t: torch.Tensor) -> bool:
        """Whether this backend moves `t`'s bytes to and from disk directly (GDS: device memory, no host copy)."""
        return False

    def read_device(self, seg: SegmentFile, out: torch.Tensor, offset: int) -> int:
        raise NotImplementedError("the POSIX backend reads into host buffers only")

    def write_device(self, seg: SegmentFile, data: torch.Tensor, offset: int) -> None:
        raise NotImplementedError("the POSIX backend writes from host buffers only")


class GdsBackend(PosixBackend):
    """KvikIO CuFile reads into and writes from device tensors; host-side I/O stays on O_DIRECT."""

    gpu_direct = True

    def __init__(self) -> None:
        super().__init__(direct=True)
        import kvikio  # only reached after the driver probe succeeded

        self._kvikio = kvikio
        self.name = "gds"

    def device_io(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def read_device(self, seg: SegmentFile, out: torch.Tensor, offset: int) -> int:
        if seg.device_handle is None:
            seg.device_handle = self._kvikio.CuFile(seg.path, "r")
        return int(seg.device_handle.pread(out, out.numel(), offset).get())

    def write_device(self, seg: SegmentFile, data: torch.Tensor, offset: int) -> None:
        """One KvikIO write from device memory (a whole extent staged on the device; aligned offset and size)."""
        handle = self._kvikio.CuFile(seg.path, "r+")
        try:
            if int(handle.pwrite(data, data.numel(), offset).get()) != data.numel():
                raise OSError(errno.ENOSPC, "short write", seg.path)
        finally:
            handle.close()


def cuda_driver_present() -> bool:
    """True when libcuda.so.1 loads and cuInit succeeds (KvikIO cannot do any I/O without it)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return int(lib.cuInit(0)) == 0
    except (OSError, AttributeError):
        return False


def _odirect_align(directory: str, readonly: bool) -> int:
    """Probe O_DIRECT in `directory` with a real aligned read (and write, unless read-only): 0 where it is refused
    (tmpfs on old kernels, ramfs: EINVAL), else the alignment reads into caller memory need: 512 where a 512-byte
    read into a 512-aligned address works, else 4096."""
    buf = AlignedBuffer(2 * DISK_ALIGNMENT)
    if readonly:
        for name in sorted(os.listdir(directory)):
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    return 0
                continue
            try:
                return _small_read_align(fd, buf) if os.fstat(fd).st_size >= DISK_ALIGNMENT else DISK_ALIGNMENT
            finally:
                os.close(fd)
        return DISK_ALIGNMENT
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return 0
        raise
    try:
        os.pwritev(fd, [buf.mv[:DISK_ALIGNMENT]], 0)
        os.preadv(fd, [buf.mv[:DISK_ALIGNMENT]], 0)
        return _small_read_align(fd, buf)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return 0
        raise
    finally:
        os.close(fd)
        os.unlink(path)


def _small_read_align(fd: int, buf: AlignedBuffer) -> int:
    try:
        os.preadv(fd, [buf.mv[_SMALL_ALIGN : 2 * _SMALL_ALIGN]], 0)
        return _SMALL_ALIGN
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return DISK_ALIGNMENT
        raise


def select_backend(directory: str, choice: str = "auto", *, readonly: bool = False) -> PosixBackend:
    """The backend for segments in `directory`: 'auto' picks gds > odirect > buffered by what works here."""
    if choice not in ("auto", "gds", "odirect", "buffered"):
        raise StoreError(f"unknown io backend {choice!r}: use auto, gds, odirect or buffered")
    if choice == "buffered":
        return PosixBackend(direct=False)
    if choice in ("auto", "gds"):
        if cuda_driver_present() and importlib.util.find_spec("kvikio") is not None:
            return GdsBackend()
        if choice == "gds":
            raise StoreError("io backend 'gds' needs libcuda.so.1 and kvikio (pip install 'kvtier[gpu]'); use auto")
    align = _odirect_align(directory, readonly)
    if align:
        return PosixBackend(direct=True, align=align)
    if choice == "odirect":
        raise StoreError(f"{directory} refuses O_DIRECT: use io backend 'auto' or 'buffered'")
    log.warning("%s refuses O_DIRECT; store segments use buffered I/O", directory)
    return PosixBackend(direct=False)
