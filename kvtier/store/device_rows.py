"""A load's rows whose target is not host memory the columns take (a device slot): how their payload gets there.

Contract:
- `gds_ready(entry)`: whether a record's payload can go by a GDS read and be checked on the device: v2, stored as
  is, with a device checksum. The batch pipeline (`packed.PackedLoad`) reads such a record's header only through the
  submit strategy when its target is one the backend reads directly (`PosixBackend.device_io`); any other record of
  a device target is read whole into the bounce buffer and checked there, as a host target's is.
- `read_device(backend, seg, out, entry)`: the payload read by the backend's device read straight into `out` (its
  header already checked) and checked there with `devsum.device_checksum`, never copied back to host.
  CorruptRecord: `segment_truncated` where the file ends inside the payload, `payload` on a checksum mismatch; the
  slot then holds the bytes read and the caller must not use it.
- `fill_device(out, entry, buf, payload_at)`: a checked record's stored payload, from `buf` at `payload_at`, into
  `out` (decoded on the host first where it is stored compressed); CorruptRecord where it does not decode.

Why apart from the columns: a device target has no host address the batch's memmoves and hashes can use, and a GDS
read is one call per payload; the rows are few (a restore's device slots), the columns' work is per object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.store.devsum import device_checksum
from kvtier.store.errors import CorruptRecord, QuarantineReason
from kvtier.store.extent import copy_out
from kvtier.store.index import IndexEntry
from kvtier.store.io import AlignedBuffer, PosixBackend, SegmentFile
from kvtier.store.record import FORMAT_VERSION, Codec, Flags, zstd_decompress_into

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch


def gds_ready(entry: IndexEntry) -> bool:
    """A record a GDS read can check on the device (the module docstring)."""
    return entry.record_version == FORMAT_VERSION and entry.codec is Codec.NONE and bool(entry.flags & Flags.DEVSUM)


def read_device(backend: PosixBackend, seg: SegmentFile, out: torch.Tensor, entry: IndexEntry) -> None:
    """The payload into `out` by the backend's device read, checked there (the module docstring)."""
    if backend.read_device(seg, out, entry.payload_offset) < entry.payload_len:
        raise CorruptRecord(QuarantineReason.SEGMENT_TRUNCATED, "segment ends inside the payload")
    if device_checksum(out) != entry.device_checksum:
        raise CorruptRecord(QuarantineReason.PAYLOAD, "payload device checksum mismatch")


def fill_device(out: torch.Tensor, entry: IndexEntry, buf: AlignedBuffer, payload_at: int) -> None:
    """A checked record's payload from the bounce buffer into a device target (the module docstring)."""
    if entry.codec is not Codec.ZSTD:
        copy_out(out, buf, payload_at, entry.payload_len)
        return
    import torch

    plain = torch.empty(entry.payload_len, dtype=torch.uint8)
    zstd_decompress_into(buf.mv[payload_at : payload_at + entry.stored_len], plain.numpy().data)
    out.copy_(plain)
