"""Linux native AIO for O_DIRECT reads: many scattered reads in flight at once from one thread.

Contract:
- `acquire()` lends an `AioContext`, or returns None where native AIO is not to be had (not Linux on x86_64 or
  aarch64, a kernel or seccomp filter that refuses io_setup, aio-max-nr reached); the caller then reads with
  threads. Give a context back with `release()` once it has nothing in flight; one thread uses it at a time.
- `AioContext.submit(ops)` queues scattered reads (`ReadOp`: a segment file opened O_DIRECT, the target memory as
  (address, length) pairs in file order, a file offset) and returns at once (where the kernel has no room, it reads
  synchronously instead); the caller keeps that memory alive until the read is returned or drained.
  `complete()` waits for at least one pending read and returns those that finished, each with the bytes it read.
  A read cut short before end of file is finished with synchronous preads before it is returned, so fewer bytes
  than asked means end of file. Keep about DEPTH reads pending (a batch may overshoot it by its size).
- A read the kernel failed is raised by `complete()` as an OSError only once nothing is in flight, so the caller's
  buffers are never freed under a read still running. After any exception, `drain()` before freeing buffers.
- Only O_DIRECT files: on a buffered file io_submit does the read synchronously, which is no better than a thread.

Why not a thread per read: one pread per thread keeps as many reads in flight as there are threads, each costing a
thread switch; the small records of a random restore want a hundred or more in flight. Random small O_DIRECT reads
all in flight through io_submit finish sooner than the same reads spread over a pool of threads, for a fraction of
the CPU (bench/store.py's small loads measure it). io_uring would do the same with fewer system calls, but a ctypes
binding of it needs ring memory shared with the kernel and ordered by barriers; of the bindings on PyPI,
python-libaio needs the system's libaio.so, caio reads into buffers it allocates itself (not the caller's pool
slot), and liburing returned completions other than documented when tried with 48 or more reads in flight.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import platform
import struct
import threading
from typing import Any, Protocol

from kvtier.store.io import SegmentFile, skip_bytes

log = logging.getLogger(__name__)

DEPTH = 128  # reads in flight per context: the disk's queue (nr_requests is 64-256 on common devices)

# A load's read geometry: the batch pipeline (`packed.PackedLoad`) cuts a payload read straight into its target into
# pieces of AIO_PIECE_BYTES and sends such reads while fewer than AIO_WINDOW_BYTES are in flight; `span_read.SpanReader`
# and the benchmarks' fio bound (`bench/fio_limit.py`) read with the same geometry. Into huge-page pool memory a piece
# goes to the disk in requests of up to max_sectors_kb (kvtier.core.hugepages). Smaller pieces in a smaller window keep
# more requests in flight for the same bytes: DSV4 restores in batches read faster so, and one large load no slower
# (bench/restore.py and bench/peers.py measure both).
AIO_WINDOW_BYTES = 32 << 20
AIO_PIECE_BYTES = 2 << 20

# (io_setup, io_getevents, io_submit) per architecture: x86_64's own table, aarch64's the generic one. Contexts are
# never destroyed: they are lent again, and the kernel frees them when the process exits.
_SYSCALLS = {"x86_64": (206, 208, 209), "aarch64": (0, 4, 2)}
_IOCB_CMD_PREADV = 7


# struct iocb and struct io_event of linux/aio_abi.h on a little-endian machine (aio_key before aio_rw_flags), and
# struct iovec. Packed with struct, not built as ctypes objects: building a ctypes iocb and iovec array costs several
# times more per read, and a random small record is a read of its own. The kernel copies iocbs and iovecs in io_submit
# (the iocb's address only comes back in its event's `obj`, which is not read here), so they live through the call.
_IOCB = struct.Struct("<QIiHhIQQqQII")
_IOVEC = struct.Struct("<QQ")
_EVENT = struct.Struct("<QQqq")
assert _IOCB.size == 64 and _EVENT.size == 32


@dataclasses.dataclass(slots=True)
class ReadOp:
    """One scattered read: fill `iov` ((address, length) pairs, in order) from `offset` of `file`. `tag` is the
    caller's. The memory at those addresses is the caller's to keep while the read is in flight."""

    file: SegmentFile
    iov: list[tuple[int, int]]
    offset: int
    tag: Any = None
    nbytes: int = 0  # the bytes the iov holds (submit sets it)


def iov_of(views: list[memoryview]) -> list[tuple[int, int]]:
    """(address, length) of each view (writable, non-empty): a ReadOp's iov."""
    return [(_address(v), len(v)) for v in views]


def _address(buf: memoryview | bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def views_of(iov: list[tuple[int, int]]) -> list[memoryview]:
    """The memory of an iov as views, for a read done synchronously (rare: a full queue, a read cut short)."""
    return [memoryview((ctypes.c_char * n).from_address(a)).cast("B") for a, n in iov]


class AioContext:
    """One kernel AIO context (see the module docstring for the contract)."""

    def __init__(self, ctx_id: int) -> None:
        self._id = ctypes.c_ulong(ctx_id)
        self._inflight: dict[int, ReadOp] = {}
        self._ready: list[tuple[ReadOp, int]] = []  # read synchronously where the kernel's queue was full
        self._events = bytearray(_EVENT.size * 2 * DEPTH)
        self._events_at = _address(self._events)
        self._error: OSError | None = None
        self._next = 0
        self._pending_bytes = 0

    @property
    def pending(self) -> int:
        """Reads submitted and not yet returned by complete()."""
        return len(self._inflight) + len(self._ready)

    @property
    def pending_bytes(self) -> int:
        """The bytes those reads ask for."""
        return self._pending_bytes

    def submit(self, ops: list[ReadOp]) -> None:
        """Queue the reads in one system call (those the kernel has no room for are read now, synchronously);
        OSError if the kernel refuses them."""
        n = len(ops)
        if not n:
            return
        cbs, iovs = bytearray(_IOCB.size * n), bytearray(_IOVEC.size * sum(len(op.iov) for op in ops))
        cbs_at, iovs_at = _address(cbs), _address(iovs) if iovs else 0
        pack_cb, pack_iov, inflight = _IOCB.pack_into, _IOVEC.pack_into, self._inflight
        v = 0
        for i, op in enumerate(ops):
            first_view, total = v, 0
            for addr, length in op.iov:
                pack_iov(iovs, v * _IOVEC.size, addr, length)
                total += length
                v += 1
            self._next += 1
            at = iovs_at + first_view * _IOVEC.size
            pack_cb(cbs, i * _IOCB.size, self._next, 0, 0, _IOCB_CMD_PREADV, 0, op.file.fd, at, v - first_view,
                    op.offset, 0, 0, 0)  # fmt: skip
            op.nbytes = total
            self._pending_bytes += total
            inflight[self._next] = op
        ptrs = bytearray(struct.pack(f"<{n}Q", *range(cbs_at, cbs_at + _IOCB.size * n, _IOCB.size)))
        ptrs_at = _address(ptrs)
        first = self._next - n + 1
        done = 0
        while done < n:
            got = _syscall(_SUBMIT, self._id, n - done, ptrs_at + done * 8)
            if got > 0:
                done += got
                continue
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            rest = [inflight.pop(first + k) for k in range(done, n)]  # none of these is in flight
            if err != errno.EAGAIN:
                self._pending_bytes -= sum(op.nbytes for op in rest)
                raise OSError(err, f"io_submit: {os.strerror(err)}", ops[done].file.path)
            self._ready += [(op, op.file.preadv_into(views_of(op.iov), op.offset)) for op in rest]  # no room: now
            return

    def complete(self) -> list[tuple[ReadOp, int]]:
        """Wait for at least one pending read; the finished ones with the bytes each read (possibly none, after a
        failed read: call again while `pending`). Raises the first failure once nothing is in flight."""
        if self._ready:
            ready, self._ready = self._ready, []
            self._pending_bytes -= sum(op.nbytes for op, _ in ready)
            return ready
        done: list[tuple[ReadOp, int]] = []
        if self._inflight:
            got = _syscall(_GETEVENTS, self._id, 1, 2 * DEPTH, self._events_at, None)
            if got < 0:
                errnum = ctypes.get_errno()
                if errnum != errno.EINTR:
                    raise OSError(errnum, f"io_getevents: {os.strerror(errnum)}")
                got = 0
            for data, _, n, _ in _EVENT.iter_unpack(self._events[: got * _EVENT.size]):
                op = self._inflight.pop(data)
                self._pending_bytes -= op.nbytes
                if n < 0:
                    self._error = self._error or OSError(-n, os.strerror(-n), op.file.path)
                    continue
                if 0 < n < op.nbytes:  # cut short inside the file: the rest synchronously, until end of file
                    n += op.file.preadv_into(skip_bytes(views_of(op.iov), n), op.offset + n)
                done.append((op, n))
        if not self._inflight and self._error is not None:
            failed, self._error = self._error, None
            self._pending_bytes -= sum(op.nbytes for op, _ in self._ready)
            self._ready.clear()
            raise failed
        return done

    def drain(self) -> None:
        """Wait out every read in flight and forget them (the caller's buffers must outlive the reads)."""
        drain(self)


class _Completes(Protocol):
    @property
    def pending(self) -> int: ...
    def complete(self) -> list[tuple[ReadOp, int]]: ...


def drain(reads: _Completes) -> None:
    """Wait out every read of a submit strategy (this module's context, or `submit.ThreadReads`) and forget them and
    any failure: `complete()` until nothing is pending, what it raises dropped (the caller is already on its way out
    of a failed load, or has nothing in flight)."""
    while reads.pending:
        try:
            reads.complete()
        except Exception:  # (a failure is raised once nothing is in flight: the loop ends after it)
            pass


_numbers = _SYSCALLS.get(platform.machine()) if os.name == "posix" and platform.system() == "Linux" else None
_libc = ctypes.CDLL(None, use_errno=True) if _numbers else None
_SETUP, _GETEVENTS, _SUBMIT = _numbers or (-1, -1, -1)


def _syscall(number: int, *args: Any) -> int:
    """syscall(2); integers go as longs (a variadic int would leave the register's upper half undefined)."""
    assert _libc is not None
    return int(_libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args)))


_free: list[AioContext] = []
_lock = threading.Lock()
_refused = _libc is None  # set once io_setup fails: the process reads with threads from then on


def acquire() -> AioContext | None:
    """A context with nothing in flight, or None where native AIO is not available here."""
    global _refused
    with _lock:
        if _free:
            return _free.pop()
        if _refused:
            return None
    ctx_id = ctypes.c_ulong(0)
    if _syscall(_SETUP, 2 * DEPTH, ctypes.byref(ctx_id)) != 0:  # room beyond DEPTH: a batch may overshoot it
        err = ctypes.get_errno()
        with _lock:
            _refused = True
        log.warning(
            "native AIO refused (io_setup: %s; fs.aio-max-nr reached, or a seccomp filter): this process reads "
            "with threads from now on",
            os.strerror(err),
        )
        return None
    return AioContext(ctx_id.value)


def release(ctx: AioContext) -> None:
    ctx.drain()
    with _lock:
        _free.append(ctx)


def _forget_in_child() -> None:
    """A forked child has none of its parent's AIO contexts (their rings are not copied): it sets up its own."""
    global _lock
    _free.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
