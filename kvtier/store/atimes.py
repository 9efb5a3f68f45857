"""Access times of loaded records, noted in memory and written to the index off the load path."""

from __future__ import annotations

import functools
import logging
import threading
import time

import lmdb

from kvtier.store.context import StoreContext
from kvtier.store.gil import Piece, applying, in_pieces
from kvtier.store.index import pack_time

log = logging.getLogger(__name__)


class AccessTimes:
    """Access times noted in memory and written by a background thread every `atime_flush_s`, so a load never
    waits for a synced index commit (LRU order is advisory). The thread writes with the decision applier's
    manners (`gil.applying`): a flush of many keys (up to 65,536 between two) goes in pieces that end once a
    durable batch waits for the write lock, it holds back while one is made durable, and it gives the GIL up to
    the loads as it goes; a flush on another thread (the store closing) is one transaction."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self._pending: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the writing thread; the store does this when it opens, not inside its first load (on a
        busy host a thread start costs as much as a hundred small records take to read)."""
        with self._lock:
            if self._thread is None and not self._stop:
                self._thread = threading.Thread(target=self._run, name="kvtier-store-atime", daemon=True)
                self._thread.start()

    def touch(self, raw_keys: list[bytes]) -> None:
        if not raw_keys:
            return
        noted = dict.fromkeys(raw_keys, time.time())  # built outside the lock, in one C call per load
        with self._lock:
            self._pending.update(noted)
            if len(self._pending) >= 65536:  # bound the memory between flushes
                self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._ctx.config.atime_flush_s)
            self._wake.clear()
            try:
                with applying():
                    self.flush()
            except Exception:  # advisory data: log, keep the thread (the next flush retries what is pending)
                log.exception("flushing access times failed")

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        index = self._ctx.index
        items = list(pending.items())

        def put(txn: lmdb.Transaction, start: int) -> tuple[None, int]:
            piece = Piece(index.writers)
            i = start
            while i < len(items) and not piece.over():
                k, t = items[i]
                i += 1
                if txn.get(k, db=index.obj) is not None:
                    txn.put(k, pack_time(t), db=index.atime)
            return None, i

        in_pieces(lambda at: index.update(functools.partial(put, start=at)), len(items))

    def close(self) -> None:
        """Stop the background thread and write what is pending (the store is closing)."""
        with self._lock:
            self._stop = True
            thread, self._thread = self._thread, None
        self._wake.set()
        if thread is not None and thread.is_alive():  # a start cut off by a signal left a thread join() refuses
            thread.join()
        self.flush()
