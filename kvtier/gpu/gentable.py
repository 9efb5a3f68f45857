"""The slot generations in host shared memory: the seqlock that lets a client re-validate its reads.

One int64 per slot of the slot table (pools of every group back to back, `BlockTable.base[g]` is group
g's first), in a memfd. The daemon writes it through its own mapping (the table's `s_gen` *is* this
memory); clients map it read-only. A slot's generation moves when the slot is unbound from its object
(evicted, freed, aborted) — always before the slot is handed out again and new bytes land in it — and
generations never repeat. So a reader that sees its lease's generation both before and after copying
a slot's bytes copied that object's bytes and nothing else. Lives in host memory on CUDA pools too.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

# linux/fcntl.h; Python's fcntl module names only some of them
F_SEAL_SHRINK = 0x0002
F_SEAL_GROW = 0x0004
F_SEAL_FUTURE_WRITE = 0x0010  # no new writable mapping or write(2), ever; existing mappings keep working
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
GEN_BYTES = 8


def seal_for_readers(fd: int) -> None:
    """Forbid every future writable mapping of a memfd (a client reopening /proc/<pid>/fd/N included);
    the daemon's own mapping, made before, stays writable."""
    fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE)


def reader_fd(fd: int) -> int:
    """A new read-only descriptor of the same memfd, to hand to a client."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


class GenerationTable:
    """`gens[slot]`: the generation of every slot, in a sealed memfd that clients map read-only."""

    def __init__(self, n_slots: int) -> None:
        self.fd = os.memfd_create("kvtier-generations", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            size = max(n_slots, 1) * GEN_BYTES
            os.ftruncate(self.fd, size)
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            seal_for_readers(self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = size
        self.reader_fd = reader_fd(self.fd)  # what attach replies hand out
        self.gens = np.frombuffer(self._mm, dtype=np.int64, count=n_slots)

    def close(self) -> None:
        """Close the descriptor; the mapping goes with the last array that views it."""
        if self.fd >= 0:
            os.close(self.fd)
            os.close(self.reader_fd)
            self.fd = self.reader_fd = -1
