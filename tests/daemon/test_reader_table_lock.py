"""A process stopped while it holds LMDB's reader-table lock never freezes the daemon.

A process registering a reader (any read transaction's first step) holds that lock for an instant; SIGSTOPped
there, it keeps it. LMDB's `reader_check` takes it once it finds a dead reader's slot, and py-lmdb holds the GIL
through that call: a daemon calling it from its housekeeping stopped every thread, its main loop included, until
the stopped process went on. The daemon reads the reader table without that lock and clears dead slots in a child
process (`kvtier.daemon.reader_slots`), so with both in place (a dead reader's slot and a stopped holder) its
housekeeping goes on and its watchdog pings keep coming; once the holder is gone the child clears the slot.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import lmdb

from kvtier.store import INDEX_DIR
from support.daemon import DaemonProc
from support.procs import process_state

# LMDB's lock file begins with its reader table's header: magic and format (4 bytes each), then the reader-table
# mutex (a process-shared robust pthread mutex, LMDB's default on Linux) at offset 8.
_HOLD_READER_TABLE_LOCK = """
import ctypes, mmap, os, signal, sys
f = open(sys.argv[1], "r+b")
mm = mmap.mmap(f.fileno(), 4096)
base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
print("held", ctypes.CDLL("libc.so.6").pthread_mutex_lock(ctypes.c_void_p(base + 8)), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""

_READ_THEN_STOP = """
import lmdb, os, signal, sys
txn = lmdb.open(sys.argv[1], max_dbs=16, readonly=True).begin()
print("reading", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_stopped_holder_of_the_reader_table_lock_does_not_freeze_the_daemon(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path, watchdog_usec=200_000)  # housekeeping (and a watchdog ping) every 0.1 s
    index = str(tmp_path / "store" / INDEX_DIR)
    readers = lmdb.open(index, max_dbs=16, readonly=True, lock=True)  # opened (it reads) before the lock is held
    procs: list[subprocess.Popen[str]] = []
    try:
        # A reader alive (stopped) while the holder takes the lock and killed after: its slot becomes a dead
        # reader's only once nobody can clear it any more, so nothing cleared it before the lock was held.
        dead = subprocess.Popen([sys.executable, "-c", _READ_THEN_STOP, index], stdout=subprocess.PIPE, text=True)
        procs.append(dead)
        assert dead.stdout is not None and dead.stdout.readline().strip() == "reading"
        holder = subprocess.Popen([sys.executable, "-c", _HOLD_READER_TABLE_LOCK, index + "/lock.mdb"],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(holder)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held 0"
        while process_state(holder.pid) != "T":
            pass  # it stops itself right after saying so
        dead.kill()
        dead.wait()
        while d.recv_notify(0.001) is not None:
            pass  # pings sent before the lock was held
        for _ in range(3):  # each ping follows a housekeeping pass run while the lock is held
            d.wait_for("WATCHDOG=1", timeout=10)
        # (env.readers() takes no lock) the dead reader's slot is still there: nobody took the lock
        assert str(dead.pid) in readers.readers().split()
        holder.kill()  # a robust mutex: the next locker (the daemon's child) recovers it
        holder.wait()
        deadline = time.monotonic() + 30
        while str(dead.pid) in readers.readers().split():
            assert time.monotonic() < deadline, f"the dead reader's slot was never cleared:\n{d.read_log()}"
            d.wait_for("WATCHDOG=1", timeout=10)  # a housekeeping pass: it reaps the child, or starts one
    finally:
        for p in procs:
            p.kill()
            p.wait()
        readers.close()
        d.close()
