"""Byte layouts of cache objects: what the kernels read, and the digest that pins it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

POOL_ALIGNMENT = 128
DISK_ALIGNMENT = 4096

DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "uint8": 1,
    "int32": 4,
}


def align_up(n: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= n."""
    return -(-n // alignment) * alignment


def slot_stride(object_bytes: int) -> int:
    """Bytes between consecutive slots of a pool of `object_bytes` objects. POOL_ALIGNMENT keeps every slot where
    the kernels may read it; an object of DISK_ALIGNMENT bytes or more also starts DISK_ALIGNMENT-aligned, as its
    payload lies on disk, so a restore reads it straight into its slot. At POOL_ALIGNMENT alone a DSV4 indexer
    slot (177,408 B) starts 256 B off a 512 B boundary every other slot, its payload went through a bounce buffer
    and a copy, which made a daemon's DSV4 load measurably slower; the padding costs less than a percent of a DSV4
    block's pool memory."""
    return align_up(object_bytes, DISK_ALIGNMENT if object_bytes >= DISK_ALIGNMENT else POOL_ALIGNMENT)


@dataclasses.dataclass(frozen=True, slots=True)
class RowLayout:
    """One row of a cache group: its element dtype, shape and byte size (which may include packing)."""

    dtype: str
    shape: tuple[int, ...]
    bytes: int

    @property
    def natural_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype] * math.prod(self.shape) if self.dtype in DTYPE_BYTES else self.bytes


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutSpec:
    """The layout of one cache object as kernels read it: (layers, rows, *row shape) of packed rows."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    row_bytes: int
    alignment: int
    abi: str

    @property
    def nbytes(self) -> int:
        """Payload bytes of one object (layers x rows x row bytes)."""
        return self.shape[0] * self.shape[1] * self.row_bytes

    @property
    def digest(self) -> bytes:
        """16-byte digest of everything a reader's kernel depends on."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=16, person=b"kvtier-layout-v1").digest()

    @staticmethod
    def packed(dtype: str, layers: int, rows: int, row_shape: tuple[int, ...], row_bytes: int, abi: str) -> LayoutSpec:
        """Layout of `layers` x `rows` packed rows, 128-byte aligned, outer byte strides contiguous."""
        return LayoutSpec(
            dtype=dtype,
            shape=(layers, rows, *row_shape),
            strides=(rows * row_bytes, row_bytes),
            row_bytes=row_bytes,
            alignment=POOL_ALIGNMENT,
            abi=abi,
        )
