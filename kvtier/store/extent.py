"""Extents: how a batch's records lie contiguously in a segment, and how far apart a load's records may lie and still
be read together.

A writer lays out each batch as one or more extents (FORMAT.md, "Extents"): a 4096-aligned run of namespace
records and object records, zero padded to a 4096 multiple, written with one pwrite. A load (`packed.PackedLoad`)
sorts what it wants by (segment, offset) and reads each run of records at most AIO_RUN_GAP apart with one aligned
read, then checks every record in it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.core.layout import DISK_ALIGNMENT, align_up
from kvtier.store.io import AlignedBuffer, BufferPool, PosixBackend, SegmentFile
from kvtier.store.record import HEADER_BYTES, RecordHeader, header_offset, record_length
from kvtier.store.segments import Appender

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

MAX_EXTENT_BYTES = 8 << 20  # a batch is cut into extents of about this size, written in parallel
# Background I/O (the verifier's checks, compaction's reads and copies) goes in pieces of this size, one at a time:
# a scan reads chunks of it one after another (`scan.PackedScan`), compaction writes each extent in pieces of it.
# Large reads or writes sent together reach the device as several requests at once, and a load whose read arrives
# behind them waits for all of them; one piece at a time leaves at most one in its way, at a cost in speed that a
# paced verifier does not feel (bench/background_io.py measures both ways of each).
BACKGROUND_IO_BYTES = 1 << 20
# With every read in flight at once (native AIO from one thread) each run costs the loading thread its Python (plan,
# place, submit, complete, check) and the kernel's work for one more request, and each byte of a gap costs the disk
# its time to read it. Bridging gaps makes fewer runs of random small records; bridged too wide, the disk reads
# several times the bytes asked for and the load waits on it instead. At this width bench/store.py's random small
# loads measured fastest: wider ones waited on the disk, narrower ones were no faster for more CPU a record.
AIO_RUN_GAP = 24 << 10


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

    def __init__(
        self, tensor: torch.Tensor | None, size: int, buf: AlignedBuffer | None, pool: BufferPool | None
    ) -> None:
        self._tensor = tensor  # the device stage's (None on the host)
        self.size = size
        self._buf = buf
        self._pool = pool

    @classmethod
    def on_host(cls, pool: BufferPool, size: int) -> Stage:
        return cls(None, size, pool.acquire(size), pool)

    @classmethod
    def on_device(cls, size: int, device: torch.device) -> Stage:
        import torch

        return cls(torch.empty(size, dtype=torch.uint8, device=device), size, None, None)

    @property
    def tensor(self) -> torch.Tensor:
        assert self._tensor is not None, "only a device stage is a tensor"
        return self._tensor

    def zero(self, at: int, n: int) -> None:
        if self._buf is not None:
            ctypes.memset(self._buf.addr + at, 0, n)
        else:
            self.tensor[at : at + n].zero_()

    def put_payload(self, at: int, data: torch.Tensor | bytes | bytearray) -> None:
        """A record's stored bytes: a tensor (an object's payload), or plain bytes on the host (compaction's copies,
        so that the verifier, which only moves bytes, never loads torch)."""
        if isinstance(data, (bytes, bytearray)):
            if self._buf is None:
                raise TypeError("a device stage takes tensors only")
            self._buf.mv[at : at + len(data)] = data
        elif self._buf is not None:
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

    def write(self, backend: PosixBackend, file: SegmentFile, offset: int, piece_bytes: int = 0) -> None:
        """The whole extent: pwrite from the host buffer (one write, or pieces of `piece_bytes`, a multiple of the
        disk alignment, one after another), or KvikIO from device memory."""
        if self._buf is not None:
            step = piece_bytes or self.size
            for at in range(0, self.size, step):
                file.pwrite_all(self._buf.mv[at : min(at + step, self.size)], offset + at)
        else:
            backend.write_device(file, self.tensor[: self.size], offset)

    def release(self) -> None:
        if self._buf is not None and self._pool is not None:
            self._pool.release(self._buf)
            self._buf = None


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
    records: Sequence[tuple[RecordHeader, torch.Tensor | bytes | bytearray]],
    device: torch.device | None,
    piece_bytes: int = 0,
) -> tuple[int, list[int]]:
    """Lay out finished records (header, stored bytes: a tensor, or plain bytes where the extent is staged on the
    host) as one extent, stage it (on `device` when given: the GDS write), place it at the appender's tail and
    write it with one call (from the host, in `piece_bytes` pieces when given: the store's `write_piece_bytes` for
    its writer, `BACKGROUND_IO_BYTES` for compaction); returns (segment, each record's offset)."""
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
        stage.write(backend, place.file, place.offset, piece_bytes)
    finally:
        stage.release()
    return place.seg_id, [place.offset + at for at in plan.offsets]
