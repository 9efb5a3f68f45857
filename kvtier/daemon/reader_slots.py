"""Clear the index's dead reader slots without the daemon ever waiting for LMDB's reader-table lock.

Contract (`ReaderSlots(store)`, `tick()` from the daemon's main loop, `close()` at shutdown):
- `tick` reads LMDB's reader table without its lock; when it holds a slot of a process that is gone, it starts a
  child process that opens the index and runs LMDB's reader check, and returns at once. One child at a time:
  until it has exited (reaped by a later tick) no other starts.
- The child may wait on the lock as long as its holder keeps it (a process stopped while it registered a reader);
  the daemon does not: py-lmdb holds the GIL through `reader_check`, so run in the daemon it stopped every thread.
- Why the slots are cleared at all: LMDB keeps the pages a dead reader's snapshot could see, so the index file
  grows, and the reader table has a fixed number of slots.
"""

from __future__ import annotations

import logging
import subprocess
import sys

from kvtier.store import DiskStore

log = logging.getLogger(__name__)

_CHECK = "import lmdb, sys; print(lmdb.open(sys.argv[1], readonly=True).reader_check())"


class ReaderSlots:
    def __init__(self, store: DiskStore) -> None:
        self._index = store.index
        self._child: subprocess.Popen[str] | None = None

    def tick(self) -> None:
        if self._child is not None:
            if self._child.poll() is None:
                return  # still waiting for the lock (or still starting)
            out, _ = self._child.communicate()
            if self._child.returncode == 0:
                log.info("cleared %s dead reader slot(s) of the index", out.strip())
            else:  # tried again at the next tick that still sees a dead slot
                log.warning("clearing the index's dead reader slots failed (exit %d)", self._child.returncode)
            self._child = None
        dead = self._index.dead_readers()
        if dead:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHECK, self._index.path],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            log.debug("clearing the reader slots of gone processes %s in pid %d", dead, self._child.pid)

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()  # it may be waiting on a stopped process's lock: nothing of it needs finishing
            self._child.wait()
            self._child = None
