"""A payload checksum computed where the payload is: torch ops only, so the same function runs on cuda and cpu.

GDS reads put a record's payload straight into a device slot; checking it with xxh3 would need a copy back to
host memory, which is what GDS exists to avoid. Records written for GDS hosts carry this checksum beside (or,
when written from device memory, instead of) the xxh3 (FORMAT.md, "Checksums").

The sum: the payload as little-endian 32-bit words w_i (zero padded), and for two primes P1 = 2^31 - 1 and
P2 = 2^31 - 19 with position weights r_k(i) = (i + 1) * A_k mod P_k,

    s_k = sum_i (w_i mod P_k) * r_k(i)  mod P_k,     checksum = (s_1 << 31 | s_2) ^ (len * GOLDEN) mod 2^64.

Every product stays below 2^62 and every partial sum below 2^63 for payloads under 4 GiB, so int64 arithmetic
is exact on every device. A single flipped bit changes w_i by ±2^b, which no nonzero weight maps to 0 modulo a
prime; swapped words are caught by the position weights; the length term tells payloads apart that differ only
by trailing zeros.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

_P = (2**31 - 1, 2**31 - 19)
_A = (1_103_515_245, 1_664_525_013)  # weight multipliers, both < P and coprime to it
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_MAX_BYTES = 1 << 32

_weights: dict[tuple[str, int], torch.Tensor] = {}
_lock = threading.Lock()


def _weight_table(device: torch.device, words: int) -> torch.Tensor:
    """(2, >= words) int64 weights for `device`, grown by doubling and shared by every payload size."""
    key = (device.type, device.index if device.index is not None else -1)
    with _lock:
        table = _weights.get(key)
        if table is None or table.shape[1] < words:
            n = max(words, 1024, 2 * (table.shape[1] if table is not None else 0))
            import torch

            i = torch.arange(1, n + 1, dtype=torch.int64, device=device)
            table = torch.stack([(i * a) % p for a, p in zip(_A, _P)])
            _weights[key] = table
        return table


def device_checksum(data: torch.Tensor) -> int:
    """The checksum of a contiguous uint8 tensor, on whatever device it lives (one small result comes to host)."""
    n = data.numel()
    import torch

    if data.dtype != torch.uint8 or not data.is_contiguous() or n >= _MAX_BYTES:
        raise ValueError("device_checksum takes a contiguous uint8 tensor under 4 GiB")
    pad = -n % 4
    if data.storage_offset() % 4:  # a dtype view needs an aligned start
        data = data.clone()
    if pad:
        data = torch.cat([data.view(-1), torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    words = data.view(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    table = _weight_table(data.device, words.numel())[:, : words.numel()]
    lanes = []
    for k, p in enumerate(_P):
        lanes.append((((words % p) * table[k]) % p).sum() % p)
    s1, s2 = (int(v) for v in torch.stack(lanes).cpu())
    return ((s1 << 31) | s2) ^ ((n * _GOLDEN) & _MASK)
