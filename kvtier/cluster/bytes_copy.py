"""Byte copies between a staging buffer and a tensor, without torch's intra-op thread pool.

A cluster object moves through staging (mooncake_client): a get lands there and is copied into the pool slot
(or the caller's tensor) after it is verified; a put is copied into staging first. For host memory these are
plain memcpys, done by numpy in the calling thread. Torch's `copy_` splits a copy of this size over its
intra-op threads, and a thread of that pool that is not running (the daemon's other threads, a machine whose
cores are busy) stalls the whole copy: a profile of a restore over a veth found these copies, not the
transfers, taking most of the load's time. The background writer's copies (promotion to local disk,
write-through) are the same kind: a pool slot copied into a buffer of the job's own. Device memory (a pool on
a GPU) still goes through torch.
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


def cpu_copy(src: torch.Tensor) -> torch.Tensor:
    """A flat CPU copy of `src` (its dtype kept), by numpy in this thread where src is contiguous host memory."""
    flat = src.detach().reshape(-1)
    if src.device.type != "cpu" or not flat.is_contiguous():
        return flat.to("cpu", copy=True)
    out = torch.empty_like(flat)
    np.copyto(out.view(torch.uint8).numpy(), flat.view(torch.uint8).numpy())
    return out
