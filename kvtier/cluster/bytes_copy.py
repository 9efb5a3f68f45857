"""Byte copies between a staging buffer and a tensor, without torch's intra-op thread pool.

A cluster object moves through staging (mooncake_client): a get lands there and is copied into the pool slot
(or the caller's tensor) after it is verified; a put is copied into staging first. For host memory these are
plain memcpys, done by numpy in the calling thread. Torch's `copy_` splits a copy of this size over its
intra-op threads, and a thread of that pool that is not running (the daemon's other threads, a machine whose
cores are busy) stalls the whole copy: a profile of a restore over a veth found these copies, not the
transfers, taking most of the load's time. Device memory (a pool on a GPU) still goes through torch.
"""

from __future__ import annotations

import numpy as np
import torch


def into_tensor(dst: torch.Tensor, src: memoryview) -> None:
    """dst (a flat uint8 tensor of len(src) elements) <- the bytes of src."""
    if dst.device.type == "cpu":
        np.copyto(dst.numpy(), np.frombuffer(src, dtype=np.uint8))
    else:
        dst.copy_(torch.frombuffer(src, dtype=torch.uint8))


def from_tensor(dst: memoryview, src: torch.Tensor) -> None:
    """The bytes of dst <- src (a flat uint8 tensor of len(dst) elements)."""
    if src.device.type == "cpu":
        np.copyto(np.frombuffer(dst, dtype=np.uint8), src.numpy())
    else:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(src)
