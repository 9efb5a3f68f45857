"""An offload's staging region (cpu): the client's memfd, sealed by the daemon, copied into reserved slots.

Clients map the pools read-only, so a client's bytes reach a slot only through here: the client fills a
memfd with its objects back to back (by write(2), or a mapping it has dropped), sends it with `seal`,
and the daemon adds F_SEAL_WRITE — which the kernel refuses while any writable mapping of it exists — so
the bytes cannot change while they are copied. Each object is read straight into its slot; how many bytes
the region really holds for it is the written size `seal` checks against the whole-block rule.
"""

from __future__ import annotations

import fcntl
import os

import torch

from kvtier.gpu.gentable import F_ADD_SEALS, F_SEAL_GROW, F_SEAL_SHRINK
from kvtier.wire.errors import WrongType

F_SEAL_WRITE = 0x0008


class StagingError(WrongType):
    """The staging region cannot be trusted to stay as it is (not a sealable memfd, or still mapped writable)."""

    code = "bad_staging"


def freeze(fd: int) -> int:
    """Seal the client's staging memfd against every write; returns its size."""
    try:
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW)
    except OSError as exc:
        raise StagingError(
            f"cannot seal the staging region ({os.strerror(exc.errno or 0)}): send a memfd made with "
            "MFD_ALLOW_SEALING and unmap it before seal"
        ) from None
    return os.fstat(fd).st_size


def copy_in(fd: int, offset: int, slot: torch.Tensor) -> int:
    """Read the staged bytes at `offset` into a cpu slot view; returns how many the region held (<= slot size)."""
    view = slot.numpy().data.cast("B")  # ndarray.data: the array as a memoryview
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got
