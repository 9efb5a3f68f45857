"""Extents: how a batch's records lie contiguously in a segment, and how a load groups them into large reads.

A writer lays out each batch as one or more extents (FORMAT.md, "Extents"): a 4096-aligned run of namespace
records and object records, zero padded to a 4096 multiple, written with one pwrite. A load sorts what it wants
by (segment, offset) and reads each run of nearby records with one aligned read, then checks every record in it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.store.io import AlignedBuffer, BufferPool, PosixBackend, SegmentFile
from kvtier.store.record import HEADER_BYTES, RecordHeader, header_offset, record_length
from kvtier.store.segments import Appender

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

MAX_EXTENT_BYTES = 8 << 20  # a batch is cut into extents of about this size, written in parallel
MAX_RUN_BYTES = 16 << 20  # one read covers at most this much (a larger record is a run of its own)
# Reading this many unwanted bytes costs less than another I/O: an O_DIRECT read costs the CPU a syscall, an
# interrupt and a wakeup whatever its size up to a few hundred KiB, about what the disk takes for this many more
# bytes; a wider gap makes fewer, larger reads of random small records (bench/store.py's small loads).
MAX_RUN_GAP = 64 << 10
# With every read in flight at once (native AIO from one thread) a read costs the disk little, but the loading
# thread a run's worth of Python (plan, place, submit, complete, check), and that is what a load of small records
# waits on: the disk sits idle between completions. A gap this wide makes several times fewer runs of random small
# records for a few more MB read, which the disk reads in less time than the CPU those runs would have cost.
AIO_RUN_GAP = 48 << 10


@dataclasses.dataclass(slots=True)
class ExtentPlan:
    """Record offsets within one extent, relative to its 4096-aligned start."""

    offsets: list[int] = dataclasses.field(default_factory=list)
    length: int = 0  # end of the last record

    def add(self, stored_len: int) -> int:
        at = header_offset(self.length, stored_len)
        self.offsets.append(at)
        self.length = at + record_length(stored_len)
        return at

    def fits(self, stored_len: int, limit: int = MAX_EXTENT_BYTES) -> bool:
        """Whether one more record keeps the extent within `limit` bytes (an empty extent takes anything)."""
        end = header_offset(self.length, stored_len) + record_length(stored_len)
        return not self.offsets or align_up(end, DISK_ALIGNMENT) <= limit

    @property
    def size(self) -> int:
        """Bytes written: the records and the zero padding up to the next 4096 boundary."""
        return align_up(self.length, DISK_ALIGNMENT)

    def zero_gaps(self, stage: Stage, lengths: Sequence[int]) -> None:
        """Zero every byte of the extent that no record covers (`lengths`: each record's length, in order)."""
        cursor = 0
        for at, n in zip(self.offsets, lengths):
            if at > cursor:
                stage.zero(cursor, at - cursor)
            cursor = at + n
        if self.size > cursor:
            stage.zero(cursor, self.size - cursor)


class Stage:
    """Where an extent is assembled before its one write: an aligned host buffer, or a device tensor (GDS)."""

    def __init__(self, tensor: torch.Tensor, size: int, buf: AlignedBuffer | None, pool: BufferPool | None) -> None:
        self.tensor = tensor
        self.size = size
        self._buf = buf
        self._pool = pool

    @classmethod
    def on_host(cls, pool: BufferPool, size: int) -> Stage:
        buf = pool.acquire(size)
        return cls(buf.tensor, size, buf, pool)

    @classmethod
    def on_device(cls, size: int, device: torch.device) -> Stage:
        import torch

        return cls(torch.empty(size, dtype=torch.uint8, device=device), size, None, None)

    def zero(self, at: int, n: int) -> None:
        if self._buf is not None:
            ctypes.memset(self._buf.addr + at, 0, n)
        else:
            self.tensor[at : at + n].zero_()

    def put_payload(self, at: int, data: torch.Tensor) -> None:
        if self._buf is not None:
            copy_in(self._buf, at, data)
        else:
            self.tensor[at : at + data.numel()].copy_(data)

    def put_header(self, header: RecordHeader, at: int) -> None:
        if self._buf is not None:
            header.pack_into(self._buf.mv, at)
        else:
            block = bytearray(HEADER_BYTES)
            header.pack_into(memoryview(block), 0)
            import torch

            self.tensor[at : at + HEADER_BYTES].copy_(torch.frombuffer(block, dtype=torch.uint8))

    def write(self, backend: PosixBackend, file: SegmentFile, offset: int) -> None:
        """The whole extent, one write: pwrite from the host buffer, or KvikIO from device memory."""
        if self._buf is not None:
            file.pwrite_all(self._buf.mv[: self.size], offset)
        else:
            backend.write_device(file, self.tensor[: self.size], offset)

    def release(self) -> None:
        if self._buf is not None and self._pool is not None:
            self._pool.release(self._buf)
            self._buf = None


J = TypeVar("J")


@dataclasses.dataclass(slots=True)
class Run(Generic[J]):
    """One aligned read [start, end) of a segment covering the records of `jobs` (sorted by offset)."""

    seg_id: int
    start: int
    end: int
    jobs: list[tuple[int, int, J]]  # (offset, record length, job)


def plan_runs(items: Sequence[tuple[int, int, int, J]], max_gap: int = MAX_RUN_GAP) -> list[Run[J]]:
    """Group (segment, offset, record length, job) into runs of records at most `max_gap` bytes apart, each one
    aligned read."""
    runs: list[Run[J]] = []
    jobs: list[tuple[int, int, J]] = []
    cur_seg = start = run_end = last_end = -1
    for seg_id, offset, length, job in sorted(items, key=_SEG_OFFSET):  # locals, not Run fields: per object
        last = offset + length
        end = last + (-last) % DISK_ALIGNMENT  # align_up, inline
        if seg_id != cur_seg or offset - last_end > max_gap or max(end, run_end) - start > MAX_RUN_BYTES:
            if jobs:
                runs.append(Run(cur_seg, start, run_end, jobs))
            cur_seg, start, run_end, jobs = seg_id, offset - offset % DISK_ALIGNMENT, end, []
        elif end > run_end:
            run_end = end
        jobs.append((offset, length, job))
        last_end = last
    if jobs:
        runs.append(Run(cur_seg, start, run_end, jobs))
    return runs


_SEG_OFFSET = operator.itemgetter(0, 1)


@dataclasses.dataclass(slots=True)
class Scatter:
    """Where one run's bytes go: chosen payloads straight into their targets (moved once, no bounce copy), and
    everything else (headers, small records, padding, unaligned tails) packed in file order into one bounce
    buffer. Built by `scatter`; a run with no direct payload is one piece, the whole run into the bounce buffer."""

    bounce_bytes: int
    pieces: list[tuple[int, int]]  # in file order: (length, job number), or (length, -1): the bounce buffer's next
    where: list[int]  # per job: where its record's first byte is in the bounce buffer
    direct: list[int]  # per job: how many leading payload bytes went straight into its target (0: none)


def scatter(run: Run[J], wants: Sequence[tuple[int, int]]) -> Scatter:
    """Plan a run's read given, per job, (payload offset, bytes it could take straight into its target; 0: none).

    A payload goes direct only where no other job of the run shares its bytes (the same record asked twice
    reads through the bounce buffer). The bytes after a direct part (a tail shorter than the alignment) follow
    the header in the bounce buffer: at `where + header length`."""
    jobs = run.jobs
    if not any(take for _, take in wants):  # the common case of small records: the whole run into the buffer
        return Scatter(
            run.end - run.start, [(run.end - run.start, -1)], [j[0] - run.start for j in jobs], [0] * len(jobs)
        )
    pieces: list[tuple[int, int]] = []
    where: list[int] = []
    direct: list[int] = []
    cursor, moved, prev_end = run.start, 0, -1
    for k, ((offset, length, _), (payload_at, take)) in enumerate(zip(jobs, wants)):
        where.append(offset - run.start - moved)
        end = offset + length
        alone = offset >= prev_end and (k + 1 == len(jobs) or jobs[k + 1][0] >= end)
        prev_end = max(prev_end, end)
        if take <= 0 or not alone:
            direct.append(0)
            continue
        if payload_at > cursor:
            pieces.append((payload_at - cursor, -1))
        pieces.append((take, k))
        direct.append(take)
        cursor = payload_at + take
        moved += take
    if run.end > cursor:
        pieces.append((run.end - cursor, -1))
    return Scatter(run.end - run.start - moved, pieces, where, direct)


def copy_out(out: torch.Tensor, buf: AlignedBuffer, at: int, n: int) -> None:
    """buf[at : at + n] into `out` (contiguous uint8): one memmove on cpu, a staged copy to a device."""
    if out.is_cpu:  # not `out.device.type`: that builds a device object, per object of every load
        ctypes.memmove(out.data_ptr(), buf.addr + at, n)
    else:
        out.copy_(buf.tensor[at : at + n], non_blocking=False)


def copy_in(buf: AlignedBuffer, at: int, src: torch.Tensor) -> None:
    """A contiguous uint8 tensor into buf[at:]: one memmove from cpu memory, a device-to-host copy otherwise."""
    n = src.numel()
    if src.is_cpu:
        ctypes.memmove(buf.addr + at, src.data_ptr(), n)
    else:
        buf.tensor[at : at + n].copy_(src)


def write_extent(
    appender: Appender,
    backend: PosixBackend,
    buffers: BufferPool,
    records: Sequence[tuple[RecordHeader, torch.Tensor]],
    device: torch.device | None,
) -> tuple[int, list[int]]:
    """Lay out finished records (header, stored bytes) as one extent, stage it (on `device` when given: the GDS
    write), place it at the appender's tail and write it with one call; returns (segment, each record's offset)."""
    plan = ExtentPlan()
    for h, _ in records:
        plan.add(h.stored_len)
    stage = Stage.on_device(plan.size, device) if device is not None else Stage.on_host(buffers, plan.size)
    try:
        plan.zero_gaps(stage, [h.record_len for h, _ in records])
        for at, (h, data) in zip(plan.offsets, records):
            stage.put_payload(at + HEADER_BYTES, data)
            stage.put_header(h, at)
        place = appender.place(plan.size)
        stage.write(backend, place.file, place.offset)
    finally:
        stage.release()
    return place.seg_id, [place.offset + at for at in plan.offsets]
